// Emulator stand-in for CUDA's <cuda_fp16.h>: everything lives in sluice_emu.h (force-included).
#ifndef SLUICE_EMU_STANDIN_CUDA_FP16_H
#define SLUICE_EMU_STANDIN_CUDA_FP16_H
#include "../sluice_emu.h"
#endif
