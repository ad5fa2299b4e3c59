// Emulator stand-in for CUDA's <sm_80_intrinsics.h>: everything lives in sluice_emu.h (force-included).
#ifndef SLUICE_EMU_STANDIN_SM_80_INTRINSICS_H
#define SLUICE_EMU_STANDIN_SM_80_INTRINSICS_H
#include "../sluice_emu.h"
#endif
