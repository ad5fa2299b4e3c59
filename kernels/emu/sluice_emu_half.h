// sluice_emu_half.h — __nv_bfloat16 / __nv_bfloat162 / __half / __half2 for the emulator.
// Included by sluice_emu.h; <cuda_bf16.h> and <cuda_fp16.h> resolve to stand-ins that include it.
//
// Conversions follow cuda_bf16.hpp / cuda_fp16.hpp: float -> bf16/half rounds to nearest even,
// NaN becomes the canonical 0x7fff, infinities and signed zeros are kept, half subnormals are
// produced. Checked against all 2^32 float inputs (docs/emulator.md).
// Arithmetic (__hadd, operator+, ...) is done in float and rounded once to the 16-bit format. For
// +, -, *, / and sqrt this is exactly the correctly rounded 16-bit result (float carries more than
// 2p+2 bits for p = 8 and p = 11), i.e. what sm_80/sm_90 produce. __hfma may differ in the last bit
// in rare double-rounding cases.
#ifndef SLUICE_EMU_HALF_H
#define SLUICE_EMU_HALF_H

namespace sluice_emu {

inline unsigned short f32_to_bf16_rn(float f) {
  unsigned u = std::bit_cast<unsigned>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  unsigned rem = u << 16;
  unsigned r = u >> 16;
  if (rem > 0x80000000u || (rem == 0x80000000u && (r & 1u))) ++r;
  return static_cast<unsigned short>(r);
}
// mode: 0 toward zero, 1 toward -inf, 2 toward +inf
inline unsigned short f32_to_bf16_dir(float f, int mode) {
  unsigned u = std::bit_cast<unsigned>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  unsigned r = u >> 16;
  bool inexact = (u & 0xffffu) != 0;
  bool neg = (u >> 31) != 0;
  if (inexact && ((mode == 1 && neg) || (mode == 2 && !neg))) ++r;
  return static_cast<unsigned short>(r);
}
inline float bf16_to_f32(unsigned short h) { return std::bit_cast<float>(static_cast<unsigned>(h) << 16); }

inline unsigned short f32_to_f16_rn(float f) {
  unsigned x = std::bit_cast<unsigned>(f);
  unsigned sign = (x >> 16) & 0x8000u;
  unsigned ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return 0x7fffu;
  if (ax >= 0x477ff000u) return static_cast<unsigned short>(sign | 0x7c00u);  // rounds to infinity
  if (ax < 0x38800000u) {                                                   // half subnormal or zero
    if (ax <= 0x33000000u) return static_cast<unsigned short>(sign);
    unsigned e = ax >> 23;
    unsigned m = (ax & 0x7fffffu) | 0x800000u;
    unsigned s = 126u - e;
    unsigned r = m >> s;
    unsigned rem = m & ((1u << s) - 1u);
    unsigned half = 1u << (s - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<unsigned short>(sign | r);
  }
  unsigned r = (((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3ffu);
  unsigned rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<unsigned short>(sign | r);
}
inline float f16_to_f32(unsigned short h) {
  unsigned sign = static_cast<unsigned>(h & 0x8000u) << 16;
  unsigned e = (h >> 10) & 0x1fu;
  unsigned m = h & 0x3ffu;
  if (e == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
  if (e == 0) {
    float v = static_cast<float>(m) * 5.9604644775390625e-8f;  // m * 2^-24, exact
    return sign ? -v : v;
  }
  return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
}

}  // namespace sluice_emu

struct __nv_bfloat16_raw { unsigned short x; };
struct __nv_bfloat162_raw { unsigned short x, y; };
struct __half_raw { unsigned short x; };
struct __half2_raw { unsigned short x, y; };

#define SLUICE_EMU_HALF_TYPE(T, RAW, TO16, FROM16)                                                 \
  struct alignas(2) T {                                                                           \
    unsigned short __x;                                                                           \
    T() = default;                                                                                \
    constexpr T(const RAW& r) : __x(r.x) {}                                                       \
    T(float f) : __x(TO16(f)) {}                                                                  \
    T(double f) : __x(TO16(static_cast<float>(f))) {}                                             \
    T(short v) : __x(TO16(static_cast<float>(v))) {}                                              \
    T(unsigned short v) : __x(TO16(static_cast<float>(v))) {}                                     \
    T(int v) : __x(TO16(static_cast<float>(v))) {}                                                \
    T(unsigned int v) : __x(TO16(static_cast<float>(v))) {}                                       \
    T(long v) : __x(TO16(static_cast<float>(v))) {}                                               \
    T(unsigned long v) : __x(TO16(static_cast<float>(v))) {}                                      \
    T(long long v) : __x(TO16(static_cast<float>(v))) {}                                          \
    T(unsigned long long v) : __x(TO16(static_cast<float>(v))) {}                                 \
    T& operator=(const RAW& r) { __x = r.x; return *this; }                                       \
    T& operator=(float f) { __x = TO16(f); return *this; }                                        \
    T& operator=(double f) { __x = TO16(static_cast<float>(f)); return *this; }                   \
    operator RAW() const { return RAW{__x}; }                                                     \
    operator float() const { return FROM16(__x); }                                                \
    explicit operator bool() const { return (__x & 0x7fffu) != 0; }                               \
    explicit operator int() const { return static_cast<int>(FROM16(__x)); }                       \
    explicit operator unsigned int() const { return static_cast<unsigned int>(FROM16(__x)); }     \
    explicit operator long long() const { return static_cast<long long>(FROM16(__x)); }           \
    explicit operator short() const { return static_cast<short>(FROM16(__x)); }                   \
    explicit operator unsigned short() const { return static_cast<unsigned short>(FROM16(__x)); } \
    explicit operator double() const { return static_cast<double>(FROM16(__x)); }                 \
  };                                                                                              \
  inline T operator+(const T& a, const T& b) { return T(static_cast<float>(a) + static_cast<float>(b)); } \
  inline T operator-(const T& a, const T& b) { return T(static_cast<float>(a) - static_cast<float>(b)); } \
  inline T operator*(const T& a, const T& b) { return T(static_cast<float>(a) * static_cast<float>(b)); } \
  inline T operator/(const T& a, const T& b) { return T(static_cast<float>(a) / static_cast<float>(b)); } \
  inline T& operator+=(T& a, const T& b) { a = a + b; return a; }                                 \
  inline T& operator-=(T& a, const T& b) { a = a - b; return a; }                                 \
  inline T& operator*=(T& a, const T& b) { a = a * b; return a; }                                 \
  inline T& operator/=(T& a, const T& b) { a = a / b; return a; }                                 \
  inline T operator+(const T& a) { return a; }                                                    \
  inline T operator-(const T& a) { T r; r.__x = static_cast<unsigned short>(a.__x ^ 0x8000u); return r; } \
  inline T& operator++(T& a) { a = a + T(1.0f); return a; }                                       \
  inline T& operator--(T& a) { a = a - T(1.0f); return a; }                                       \
  inline T operator++(T& a, int) { T o = a; ++a; return o; }                                      \
  inline T operator--(T& a, int) { T o = a; --a; return o; }                                      \
  inline bool operator==(const T& a, const T& b) { return static_cast<float>(a) == static_cast<float>(b); } \
  inline bool operator!=(const T& a, const T& b) { return static_cast<float>(a) != static_cast<float>(b); } \
  inline bool operator<(const T& a, const T& b) { return static_cast<float>(a) < static_cast<float>(b); }  \
  inline bool operator>(const T& a, const T& b) { return static_cast<float>(a) > static_cast<float>(b); }  \
  inline bool operator<=(const T& a, const T& b) { return static_cast<float>(a) <= static_cast<float>(b); } \
  inline bool operator>=(const T& a, const T& b) { return static_cast<float>(a) >= static_cast<float>(b); }

SLUICE_EMU_HALF_TYPE(__nv_bfloat16, __nv_bfloat16_raw, sluice_emu::f32_to_bf16_rn, sluice_emu::bf16_to_f32)
SLUICE_EMU_HALF_TYPE(__half, __half_raw, sluice_emu::f32_to_f16_rn, sluice_emu::f16_to_f32)
#undef SLUICE_EMU_HALF_TYPE

#define SLUICE_EMU_HALF2_TYPE(T2, T, RAW2)                                                         \
  struct alignas(4) T2 {                                                                          \
    T x, y;                                                                                       \
    T2() = default;                                                                               \
    constexpr T2(const T& a, const T& b) : x(a), y(b) {}                                          \
    T2(const RAW2& r) : x(__nv_raw_of<T>(r.x)), y(__nv_raw_of<T>(r.y)) {}                         \
    operator RAW2() const { return RAW2{x.__x, y.__x}; }                                          \
  };                                                                                              \
  inline T2 operator+(const T2& a, const T2& b) { return T2(a.x + b.x, a.y + b.y); }              \
  inline T2 operator-(const T2& a, const T2& b) { return T2(a.x - b.x, a.y - b.y); }              \
  inline T2 operator*(const T2& a, const T2& b) { return T2(a.x * b.x, a.y * b.y); }              \
  inline T2 operator/(const T2& a, const T2& b) { return T2(a.x / b.x, a.y / b.y); }              \
  inline T2& operator+=(T2& a, const T2& b) { a = a + b; return a; }                              \
  inline T2& operator-=(T2& a, const T2& b) { a = a - b; return a; }                              \
  inline T2& operator*=(T2& a, const T2& b) { a = a * b; return a; }                              \
  inline T2& operator/=(T2& a, const T2& b) { a = a / b; return a; }                              \
  inline T2 operator-(const T2& a) { return T2(-a.x, -a.y); }                                     \
  inline bool operator==(const T2& a, const T2& b) { return a.x == b.x && a.y == b.y; }           \
  inline bool operator!=(const T2& a, const T2& b) { return !(a == b); }

template <class T> inline T __nv_raw_of(unsigned short bits) {
  T r;
  r.__x = bits;
  return r;
}
SLUICE_EMU_HALF2_TYPE(__nv_bfloat162, __nv_bfloat16, __nv_bfloat162_raw)
SLUICE_EMU_HALF2_TYPE(__half2, __half, __half2_raw)
#undef SLUICE_EMU_HALF2_TYPE

typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;
typedef __half half;
typedef __half2 half2;

// ---- bf16 conversions ----
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_raw_of<__nv_bfloat16>(sluice_emu::f32_to_bf16_rn(f)); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) { return __nv_raw_of<__nv_bfloat16>(sluice_emu::f32_to_bf16_dir(f, 0)); }
inline __nv_bfloat16 __float2bfloat16_rd(float f) { return __nv_raw_of<__nv_bfloat16>(sluice_emu::f32_to_bf16_dir(f, 1)); }
inline __nv_bfloat16 __float2bfloat16_ru(float f) { return __nv_raw_of<__nv_bfloat16>(sluice_emu::f32_to_bf16_dir(f, 2)); }
inline __nv_bfloat16 __double2bfloat16(double d) { return __float2bfloat16(static_cast<float>(d)); }
inline float __bfloat162float(__nv_bfloat16 h) { return sluice_emu::bf16_to_f32(h.__x); }
inline __nv_bfloat162 __float2bfloat162_rn(float f) { return __nv_bfloat162(__float2bfloat16(f), __float2bfloat16(f)); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return __nv_bfloat162(__float2bfloat16(a), __float2bfloat16(b)); }
inline __nv_bfloat162 __float22bfloat162_rn(float2 f) { return __floats2bfloat162_rn(f.x, f.y); }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return make_float2(__bfloat162float(h.x), __bfloat162float(h.y)); }
inline float __low2float(__nv_bfloat162 h) { return __bfloat162float(h.x); }
inline float __high2float(__nv_bfloat162 h) { return __bfloat162float(h.y); }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 h) { return h.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 h) { return h.y; }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat162(a, b); }
inline __nv_bfloat162 make_bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat162(a, b); }
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 a) { return __nv_bfloat162(a, a); }
inline __nv_bfloat162 __low2bfloat162(__nv_bfloat162 a) { return __nv_bfloat162(a.x, a.x); }
inline __nv_bfloat162 __high2bfloat162(__nv_bfloat162 a) { return __nv_bfloat162(a.y, a.y); }
inline __nv_bfloat162 __lows2bfloat162(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(a.x, b.x); }
inline __nv_bfloat162 __highs2bfloat162(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(a.y, b.y); }
inline __nv_bfloat162 __lowhigh2highlow(__nv_bfloat162 a) { return __nv_bfloat162(a.y, a.x); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline short __bfloat16_as_short(__nv_bfloat16 h) { return static_cast<short>(h.__x); }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short v) { return __nv_raw_of<__nv_bfloat16>(v); }
inline __nv_bfloat16 __short_as_bfloat16(short v) { return __nv_raw_of<__nv_bfloat16>(static_cast<unsigned short>(v)); }
inline __nv_bfloat16 __int2bfloat16_rn(int v) { return __float2bfloat16(static_cast<float>(v)); }
inline int __bfloat162int_rn(__nv_bfloat16 h) { return static_cast<int>(nearbyintf(__bfloat162float(h))); }
inline int __bfloat162int_rz(__nv_bfloat16 h) { return static_cast<int>(__bfloat162float(h)); }

// ---- half conversions ----
inline __half __float2half(float f) { return __nv_raw_of<__half>(sluice_emu::f32_to_f16_rn(f)); }
inline __half __float2half_rn(float f) { return __float2half(f); }
inline float __half2float(__half h) { return sluice_emu::f16_to_f32(h.__x); }
inline __half2 __float2half2_rn(float f) { return __half2(__float2half(f), __float2half(f)); }
inline __half2 __floats2half2_rn(float a, float b) { return __half2(__float2half(a), __float2half(b)); }
inline __half2 __float22half2_rn(float2 f) { return __floats2half2_rn(f.x, f.y); }
inline float2 __half22float2(__half2 h) { return make_float2(__half2float(h.x), __half2float(h.y)); }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline __half2 __halves2half2(__half a, __half b) { return __half2(a, b); }
inline __half2 make_half2(__half a, __half b) { return __half2(a, b); }
inline __half2 __half2half2(__half a) { return __half2(a, a); }
inline __half2 __lowhigh2highlow(__half2 a) { return __half2(a.y, a.x); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline short __half_as_short(__half h) { return static_cast<short>(h.__x); }
inline __half __ushort_as_half(unsigned short v) { return __nv_raw_of<__half>(v); }
inline __half __short_as_half(short v) { return __nv_raw_of<__half>(static_cast<unsigned short>(v)); }
inline __half __int2half_rn(int v) { return __float2half(static_cast<float>(v)); }
inline int __half2int_rn(__half h) { return static_cast<int>(nearbyintf(__half2float(h))); }
inline int __half2int_rz(__half h) { return static_cast<int>(__half2float(h)); }

// ---- arithmetic and comparison intrinsics, both formats ----
#define SLUICE_EMU_HALF_MATH(T, T2)                                                                 \
  inline T __hadd(T a, T b) { return a + b; }                                                      \
  inline T __hsub(T a, T b) { return a - b; }                                                      \
  inline T __hmul(T a, T b) { return a * b; }                                                      \
  inline T __hdiv(T a, T b) { return a / b; }                                                      \
  inline T __hadd_rn(T a, T b) { return a + b; }                                                   \
  inline T __hsub_rn(T a, T b) { return a - b; }                                                   \
  inline T __hmul_rn(T a, T b) { return a * b; }                                                   \
  inline T __hfma(T a, T b, T c) { return T(fmaf(static_cast<float>(a), static_cast<float>(b), static_cast<float>(c))); } \
  inline T __hneg(T a) { return -a; }                                                              \
  inline T __habs(T a) { T r; r.__x = static_cast<unsigned short>(a.__x & 0x7fffu); return r; }    \
  inline T __hmax(T a, T b) { return T(fmaxf(static_cast<float>(a), static_cast<float>(b))); }     \
  inline T __hmin(T a, T b) { return T(fminf(static_cast<float>(a), static_cast<float>(b))); }     \
  inline bool __hisnan(T a) { return (a.__x & 0x7fffu) > __nv_inf_bits(a); }                       \
  inline int __hisinf(T a) { return (a.__x & 0x7fffu) == __nv_inf_bits(a) ? ((a.__x & 0x8000u) ? -1 : 1) : 0; } \
  inline T __hmax_nan(T a, T b) { return (__hisnan(a) || __hisnan(b)) ? __nv_raw_of<T>(0x7fffu) : __hmax(a, b); } \
  inline T __hmin_nan(T a, T b) { return (__hisnan(a) || __hisnan(b)) ? __nv_raw_of<T>(0x7fffu) : __hmin(a, b); } \
  inline bool __heq(T a, T b) { return a == b; }                                                   \
  inline bool __hne(T a, T b) { return a != b; }                                                   \
  inline bool __hlt(T a, T b) { return a < b; }                                                    \
  inline bool __hle(T a, T b) { return a <= b; }                                                   \
  inline bool __hgt(T a, T b) { return a > b; }                                                    \
  inline bool __hge(T a, T b) { return a >= b; }                                                   \
  inline T hexp(T a) { return T(expf(static_cast<float>(a))); }                                    \
  inline T hexp2(T a) { return T(exp2f(static_cast<float>(a))); }                                  \
  inline T hlog(T a) { return T(logf(static_cast<float>(a))); }                                    \
  inline T hlog2(T a) { return T(log2f(static_cast<float>(a))); }                                  \
  inline T hsqrt(T a) { return T(sqrtf(static_cast<float>(a))); }                                 \
  inline T hrsqrt(T a) { return T(1.0f / sqrtf(static_cast<float>(a))); }                          \
  inline T hrcp(T a) { return T(1.0f / static_cast<float>(a)); }                                   \
  inline T htanh(T a) { return T(tanhf(static_cast<float>(a))); }                                  \
  inline T2 __hadd2(T2 a, T2 b) { return a + b; }                                                  \
  inline T2 __hsub2(T2 a, T2 b) { return a - b; }                                                  \
  inline T2 __hmul2(T2 a, T2 b) { return a * b; }                                                  \
  inline T2 __h2div(T2 a, T2 b) { return a / b; }                                                  \
  inline T2 __hfma2(T2 a, T2 b, T2 c) { return T2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)); } \
  inline T2 __hneg2(T2 a) { return -a; }                                                           \
  inline T2 __habs2(T2 a) { return T2(__habs(a.x), __habs(a.y)); }                                 \
  inline T2 __hmax2(T2 a, T2 b) { return T2(__hmax(a.x, b.x), __hmax(a.y, b.y)); }                 \
  inline T2 __hmin2(T2 a, T2 b) { return T2(__hmin(a.x, b.x), __hmin(a.y, b.y)); }

constexpr unsigned short __nv_inf_bits(__nv_bfloat16) { return 0x7f80u; }
constexpr unsigned short __nv_inf_bits(__half) { return 0x7c00u; }
SLUICE_EMU_HALF_MATH(__nv_bfloat16, __nv_bfloat162)
SLUICE_EMU_HALF_MATH(__half, __half2)
#undef SLUICE_EMU_HALF_MATH

#endif  // SLUICE_EMU_HALF_H
