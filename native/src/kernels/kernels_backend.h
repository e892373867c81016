// Registration of the multi-row kernels with ggml-cpu (cpu_buffer.cpp) and their self-test
// (selftest.cpp). Internal to libdflash.
#pragma once

#include "ggml-backend.h"

#include <string>

namespace dflash::kern {

// Put our buffer type at the front of ggml-cpu's extra buffer types. Call before the first model
// load of the process (idempotent). False if it could not be registered (then stock ggml runs).
bool install();
bool installed();

// New weights go to our buffer only while placement is enabled: mode -1 = follow PYDFLASH_KERNELS
// (default), 0 = off, 1 = on. Read at each model load.
bool placement_enabled();
void set_placement(int mode);
// Most activation rows (of one mat-mul) our kernels take; -1 = PYDFLASH_KERNELS_MAX_ROWS / default.
void set_max_rows(int n);
// One-row mat-muls of the legacy types go to ggml's vec_dot (faster there); the self-test turns
// that off to check our path.
void set_legacy_single_row(bool on);

// Our attention (attention.h): mode -1 = for the models whose weights are in our buffer unless
// PYDFLASH_KERNELS_ATTN=0 (default), 0 = never, 1 = every FLASH_ATTN_EXT we cover (self-test),
// 2 = for the models whose weights are in our buffer.
void set_attention(int mode);

ggml_backend_buffer_type_t buffer_type();

// Checks every covered type against ggml's CPU mat-mul and a float64 reference (selftest.cpp).
// isa: "scalar", "avx2", "auto" (best). Returns the number of failed cases; report gets a summary.
int selftest(const char * isa, int n_threads, int quick, std::string & report, double & worst_nmse);

}  // namespace dflash::kern
