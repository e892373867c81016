// The compute devices of this ggml build, and ggml RPC servers as extra devices.
#pragma once

#include "dflash.h"

#include <cstdint>

namespace dflash {

int32_t            device_count();
dflash_device_info device_info(int32_t index);
// Registers the devices of the RPC server at endpoint "host:port" (once per endpoint).
void               add_rpc_server(const char * endpoint);

}  // namespace dflash
