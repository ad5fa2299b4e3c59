// Emulator stand-in for CUDA's <vector_types.h>: everything lives in sluice_emu.h (force-included).
#ifndef SLUICE_EMU_STANDIN_VECTOR_TYPES_H
#define SLUICE_EMU_STANDIN_VECTOR_TYPES_H
#include "../sluice_emu.h"
#endif
