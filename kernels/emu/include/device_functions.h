// Emulator stand-in for CUDA's <device_functions.h>: everything lives in sluice_emu.h (force-included).
#ifndef SLUICE_EMU_STANDIN_DEVICE_FUNCTIONS_H
#define SLUICE_EMU_STANDIN_DEVICE_FUNCTIONS_H
#include "../sluice_emu.h"
#endif
