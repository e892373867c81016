// Devices come from ggml's backend registry: the CPU always, GPU backends the build was
// configured with, and the devices of RPC servers added at run time. The RPC client is reached
// through the registry's proc-address table, so a build without GGML_RPC needs no stub.
#include "devices.h"

#include "error.h"

#include "ggml-backend.h"

#include <mutex>
#include <set>
#include <string>

namespace dflash {

int32_t device_count() { return int32_t(ggml_backend_dev_count()); }

dflash_device_info device_info(int32_t index) {
    if (index < 0 || index >= device_count()) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "device index %d is outside 0..%d", index, device_count() - 1);
    }
    ggml_backend_dev_t dev = ggml_backend_dev_get(size_t(index));
    dflash_device_info out{};
    out.name        = ggml_backend_dev_name(dev);
    out.description = ggml_backend_dev_description(dev);
    switch (ggml_backend_dev_type(dev)) {
        case GGML_BACKEND_DEVICE_TYPE_CPU:   out.type = DFLASH_DEVICE_CPU;   break;
        case GGML_BACKEND_DEVICE_TYPE_GPU:   out.type = DFLASH_DEVICE_GPU;   break;
        case GGML_BACKEND_DEVICE_TYPE_IGPU:  out.type = DFLASH_DEVICE_IGPU;  break;
        default:                             out.type = DFLASH_DEVICE_ACCEL; break;
    }
    size_t free = 0, total = 0;
    ggml_backend_dev_memory(dev, &free, &total);
    out.memory_free  = free;
    out.memory_total = total;
    return out;
}

void add_rpc_server(const char * endpoint) {
    const std::string ep = endpoint ? endpoint : "";
    const size_t colon = ep.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == ep.size() ||
        ep.find_first_not_of("0123456789", colon + 1) != std::string::npos) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "RPC endpoint '%s' is not host:port", ep.c_str());
    }
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    if (!rpc) {
        fail(DFLASH_ERR_UNSUPPORTED, "this build has no RPC backend (configure with -DGGML_RPC=ON)");
    }
    using add_server_fn = ggml_backend_reg_t (*)(const char *);
    auto add_server = reinterpret_cast<add_server_fn>(ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_add_server"));
    if (!add_server) {
        fail(DFLASH_ERR_UNSUPPORTED, "the RPC backend of this build cannot add servers");
    }
    static std::mutex mutex;
    static std::set<std::string> added;
    std::lock_guard<std::mutex> lock(mutex);
    if (added.count(ep)) {
        return;
    }
    ggml_backend_reg_t reg = add_server(ep.c_str());
    if (!reg) {
        fail(DFLASH_ERR_BACKEND, "RPC server %s offers no devices", ep.c_str());
    }
    ggml_backend_register(reg);
    added.insert(ep);
}

}  // namespace dflash
