// Emulator stand-in for CUDA's <cuda_bf16.h>: everything lives in sluice_emu.h (force-included).
#ifndef SLUICE_EMU_STANDIN_CUDA_BF16_H
#define SLUICE_EMU_STANDIN_CUDA_BF16_H
#include "../sluice_emu.h"
#endif
