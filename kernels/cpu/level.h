// The instruction-set level a translation unit of graphspec's CPU backend is compiled for, and the op namespace
// it registers under. graphspec.kernels.cpu builds every C++ file once per level, each time with that level's
// -m flags and -DGS_NS=graphspec_cpu_<level>, so several levels load side by side in one process (the tests run
// each level the machine can execute) and each binary holds only the instructions of its own level.
//
//   amx:     avx512 + AMX tiles for bf16 (Intel Sapphire Rapids and later): the bf16 linear on tiles, the rest avx512's
//   avx512:  AVX-512 F/BW/VL/DQ + BF16 + VNNI (AMD Zen 4, Intel Sapphire Rapids and later)
//   avx2:    AVX2 + FMA + F16C (most x86 CPUs since 2013: AMD Zen 1-3, Intel Haswell and later)
//   generic: no -m flags: plain C++ the compiler vectorizes for the baseline of its target (any CPU)
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__) && \
    defined(__AVX512VNNI__)
#define GS_AVX512 1
#else
#define GS_AVX512 0
#endif

// amx is avx512 plus tile products: every avx512 branch compiles for it too, and GS_AMX picks the tile paths.
#if GS_AVX512 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define GS_AMX 1
#else
#define GS_AMX 0
#endif

#if !GS_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GS_AVX2 1
#else
#define GS_AVX2 0
#endif

#if GS_AVX512 || GS_AVX2
#include <immintrin.h>
#endif

#define GS_HAVE_VNNI GS_AVX512  // int8_gemm.h / int4_gemm.h: vpdpbusd
#define GS_HAVE_INT4 (GS_AVX512 || GS_AVX2)  // int4_gemm.h: vpdpbusd, or vpmaddubsw + vpmaddwd

#if GS_AMX
#define GS_LEVEL_NAME "amx"
#elif GS_AVX512
#define GS_LEVEL_NAME "avx512"
#elif GS_AVX2
#define GS_LEVEL_NAME "avx2"
#else
#define GS_LEVEL_NAME "generic"
#endif

#ifndef GS_NS
#error "build with -DGS_NS=<op namespace>, as graphspec.kernels.cpu does"
#endif

// TORCH_LIBRARY pastes its namespace argument, so a macro must be expanded one level up.
#define GS_LIBRARY_(ns, m) TORCH_LIBRARY(ns, m)
#define GS_LIBRARY(m) GS_LIBRARY_(GS_NS, m)
#define GS_LIBRARY_FRAGMENT_(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define GS_LIBRARY_FRAGMENT(m) GS_LIBRARY_FRAGMENT_(GS_NS, m)
