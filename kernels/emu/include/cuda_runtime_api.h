// Emulator stand-in for CUDA's <cuda_runtime_api.h>: everything lives in sluice_emu.h (force-included).
#ifndef SLUICE_EMU_STANDIN_CUDA_RUNTIME_API_H
#define SLUICE_EMU_STANDIN_CUDA_RUNTIME_API_H
#include "../sluice_emu.h"
#endif
