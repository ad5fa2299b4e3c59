// Emulator stand-in for CUDA's <cuda.h>: everything lives in sluice_emu.h (force-included).
#ifndef SLUICE_EMU_STANDIN_CUDA_H
#define SLUICE_EMU_STANDIN_CUDA_H
#include "../sluice_emu.h"
#endif
