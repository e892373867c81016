#include "gguf_check.h"

#include "error.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sys/stat.h>

namespace dflash {

gguf_ptr check_gguf_file(const char * path, const char * what) {
    if (!path || !*path) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "no %s path given", what);
    }
    struct stat st {};
    if (stat(path, &st) != 0) {
        fail(DFLASH_ERR_IO, "%s '%s': %s", what, path, strerror(errno));
    }
    if (!S_ISREG(st.st_mode)) {
        fail(DFLASH_ERR_IO, "%s '%s' is not a regular file", what, path);
    }
    FILE * f = fopen(path, "rb");
    if (!f) {
        fail(DFLASH_ERR_IO, "%s '%s': %s", what, path, strerror(errno));
    }
    char magic[4] = {0};
    const size_t got = fread(magic, 1, 4, f);
    fclose(f);
    if (got != 4 || memcmp(magic, "GGUF", 4) != 0) {
        fail(DFLASH_ERR_FORMAT, "%s '%s' is not a GGUF file (bad magic)", what, path);
    }

    gguf_init_params params = {/*no_alloc =*/true, /*ctx =*/nullptr};
    gguf_ptr ctx(gguf_init_from_file(path, params));
    if (!ctx) {
        fail(DFLASH_ERR_FORMAT, "%s '%s' is not a valid GGUF file (corrupt or truncated header)", what, path);
    }
    // Every tensor's data must lie inside the file.
    const size_t data_offset = gguf_get_data_offset(ctx.get());
    size_t end = data_offset;
    for (int64_t i = 0; i < gguf_get_n_tensors(ctx.get()); ++i) {
        const size_t tensor_end = data_offset + gguf_get_tensor_offset(ctx.get(), i) + gguf_get_tensor_size(ctx.get(), i);
        end = tensor_end > end ? tensor_end : end;
    }
    if (end > size_t(st.st_size)) {
        fail(DFLASH_ERR_FORMAT, "%s '%s' is truncated: its tensors need %zu bytes, the file has %lld",
             what, path, end, (long long) st.st_size);
    }
    return ctx;
}

}  // namespace dflash
