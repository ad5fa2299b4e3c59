// Emulator stand-in for CUDA's <device_launch_parameters.h>: everything lives in sluice_emu.h (force-included).
#ifndef SLUICE_EMU_STANDIN_DEVICE_LAUNCH_PARAMETERS_H
#define SLUICE_EMU_STANDIN_DEVICE_LAUNCH_PARAMETERS_H
#include "../sluice_emu.h"
#endif
