// Typed, checked reads of GGUF metadata (gguf_get_val_* abort on a type mismatch; these throw
// DFLASH_ERR_FORMAT naming the file and key instead), a parsed GGUF with its tensor shapes, and a
// read-only file mapping.
#pragma once

#include "error.h"
#include "gguf_check.h"

#include "ggml-cpp.h"
#include "gguf.h"

#include <cstdint>
#include <string>
#include <vector>

namespace dflash {

// Metadata reader of one GGUF; messages name the file and the key.
struct GgufMeta {
    const gguf_context * ctx;
    std::string          path;

    int64_t find(const std::string & key) const { return gguf_find_key(ctx, key.c_str()); }
    bool has(const std::string & key) const { return find(key) >= 0; }

    int64_t need(const std::string & key) const {
        const int64_t id = find(key);
        if (id < 0) {
            fail(DFLASH_ERR_FORMAT, "'%s' has no '%s' in its metadata", path.c_str(), key.c_str());
        }
        return id;
    }

    int64_t integer(const std::string & key) const { return integer_at(need(key), key); }
    int64_t integer(const std::string & key, int64_t def) const { return has(key) ? integer(key) : def; }

    int64_t integer_at(int64_t id, const std::string & key) const {
        switch (gguf_get_kv_type(ctx, id)) {
            case GGUF_TYPE_UINT8:  return gguf_get_val_u8(ctx, id);
            case GGUF_TYPE_INT8:   return gguf_get_val_i8(ctx, id);
            case GGUF_TYPE_UINT16: return gguf_get_val_u16(ctx, id);
            case GGUF_TYPE_INT16:  return gguf_get_val_i16(ctx, id);
            case GGUF_TYPE_UINT32: return gguf_get_val_u32(ctx, id);
            case GGUF_TYPE_INT32:  return gguf_get_val_i32(ctx, id);
            case GGUF_TYPE_UINT64: return int64_t(gguf_get_val_u64(ctx, id));
            case GGUF_TYPE_INT64:  return gguf_get_val_i64(ctx, id);
            default: fail(DFLASH_ERR_FORMAT, "'%s': '%s' is not an integer", path.c_str(), key.c_str());
        }
    }

    float real(const std::string & key, float def) const {
        const int64_t id = find(key);
        if (id < 0) {
            return def;
        }
        switch (gguf_get_kv_type(ctx, id)) {
            case GGUF_TYPE_FLOAT32: return gguf_get_val_f32(ctx, id);
            case GGUF_TYPE_FLOAT64: return float(gguf_get_val_f64(ctx, id));
            default: return float(integer_at(id, key));
        }
    }

    bool flag(const std::string & key, bool def) const {
        const int64_t id = find(key);
        if (id < 0) {
            return def;
        }
        if (gguf_get_kv_type(ctx, id) != GGUF_TYPE_BOOL) {
            fail(DFLASH_ERR_FORMAT, "'%s': '%s' is not a bool", path.c_str(), key.c_str());
        }
        return gguf_get_val_bool(ctx, id);
    }

    std::string str(const std::string & key) const {
        const int64_t id = need(key);
        if (gguf_get_kv_type(ctx, id) != GGUF_TYPE_STRING) {  // gguf_get_val_str would abort
            fail(DFLASH_ERR_FORMAT, "'%s': '%s' is not a string", path.c_str(), key.c_str());
        }
        return gguf_get_val_str(ctx, id);
    }

    std::vector<int64_t> int_array(const std::string & key) const {
        const int64_t id = need(key);
        if (gguf_get_kv_type(ctx, id) != GGUF_TYPE_ARRAY) {
            fail(DFLASH_ERR_FORMAT, "'%s': '%s' is not an array", path.c_str(), key.c_str());
        }
        const gguf_type type = gguf_get_arr_type(ctx, id);
        if (type != GGUF_TYPE_INT32 && type != GGUF_TYPE_UINT32 && type != GGUF_TYPE_INT64 && type != GGUF_TYPE_BOOL) {
            fail(DFLASH_ERR_FORMAT, "'%s': '%s' is not an integer array", path.c_str(), key.c_str());
        }
        const size_t n = gguf_get_arr_n(ctx, id);
        const void * data = gguf_get_arr_data(ctx, id);
        std::vector<int64_t> out(n);
        for (size_t i = 0; i < n; ++i) {
            switch (type) {
                case GGUF_TYPE_INT32:  out[i] = static_cast<const int32_t *>(data)[i]; break;
                case GGUF_TYPE_UINT32: out[i] = static_cast<const uint32_t *>(data)[i]; break;
                case GGUF_TYPE_INT64:  out[i] = static_cast<const int64_t *>(data)[i]; break;
                default:               out[i] = static_cast<const int8_t *>(data)[i] != 0; break;  // bool
            }
        }
        return out;
    }

    std::vector<float> real_array(const std::string & key) const {
        const int64_t id = need(key);
        if (gguf_get_kv_type(ctx, id) != GGUF_TYPE_ARRAY) {
            fail(DFLASH_ERR_FORMAT, "'%s': '%s' is not an array", path.c_str(), key.c_str());
        }
        const gguf_type type = gguf_get_arr_type(ctx, id);
        if (type != GGUF_TYPE_FLOAT32 && type != GGUF_TYPE_FLOAT64) {
            fail(DFLASH_ERR_FORMAT, "'%s': '%s' is not a float array", path.c_str(), key.c_str());
        }
        const size_t n = gguf_get_arr_n(ctx, id);
        const void * data = gguf_get_arr_data(ctx, id);
        std::vector<float> out(n);
        for (size_t i = 0; i < n; ++i) {
            out[i] = type == GGUF_TYPE_FLOAT32 ? static_cast<const float *>(data)[i]
                                               : float(static_cast<const double *>(data)[i]);
        }
        return out;
    }

    size_t array_len(const std::string & key) const {
        const int64_t id = find(key);
        return id < 0 || gguf_get_kv_type(ctx, id) != GGUF_TYPE_ARRAY ? 0 : gguf_get_arr_n(ctx, id);
    }
};

struct ParsedGguf {
    gguf_ptr         gguf;
    ggml_context_ptr meta;  // tensor shapes/types (no data)
};

inline ParsedGguf open_gguf(const char * path, const char * what) {
    check_gguf_file(path, what);  // precise IO/format errors first
    ParsedGguf p;
    ggml_context * meta = nullptr;
    gguf_init_params params = {/*no_alloc =*/true, /*ctx =*/&meta};
    p.gguf.reset(gguf_init_from_file(path, params));
    if (!p.gguf) {
        fail(DFLASH_ERR_FORMAT, "%s '%s' is not a valid GGUF file", what, path);
    }
    p.meta.reset(meta);
    return p;
}

// Read-only mapping of a whole file (POSIX mmap).
struct MappedFile {
    void * addr = nullptr;
    size_t size = 0;
    MappedFile(const char * path, const char * what);
    ~MappedFile();
    MappedFile(const MappedFile &) = delete;
    MappedFile & operator=(const MappedFile &) = delete;
};

}  // namespace dflash
