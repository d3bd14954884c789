// Host queries of the current device that launches plan with (include from .cu only).

#pragma once

#include <cuda_runtime.h>

namespace dflash {

// The current device's `attribute`, or 0 where the query fails; its error is cleared, so that
// the launch that follows reports only its own.
inline int device_attribute(cudaDeviceAttr attribute) {
  int device = 0, value = 0;
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&value, attribute, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return value;
}

inline int device_sms() { return device_attribute(cudaDevAttrMultiProcessorCount); }

}  // namespace dflash
