// Emulator stand-in for <assert.h> / <cassert>: a failed assert() inside a kernel is reported as an
// error of the launch (kernel, block, thread, expression, file:line) instead of aborting the process.
// No include guard, like the real <assert.h>.
#include_next <assert.h>
#ifdef __cplusplus
extern "C" [[noreturn]] void sluice_emu_assert_fail(const char* expr, const char* file, unsigned line);
#undef assert
#ifdef NDEBUG
#define assert(e) (static_cast<void>(0))
#else
#define assert(e) ((e) ? static_cast<void>(0) : sluice_emu_assert_fail(#e, __FILE__, __LINE__))
#endif
#endif
