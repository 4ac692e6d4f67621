/* Whether this process runs AMX-BF16 tile products, decided alike by each library that uses them
 * (layers/csrc/quant_amx.c: the bfloat16 products; attention/csrc/paged_bf16.c: attention scores
 * over a bfloat16 cache), both built with -I on this folder; and the pieces the AMX-INT8 products
 * decide with (layers/csrc/quant_amx_i8.c: amx_permitted, then amx_probe of its own product).
 * Included once per library, whose first line defines _DEFAULT_SOURCE (syscall under -std=c11)
 * before any header.
 *
 * amx_decide() runs once, from a library's constructor while dlopen loads it: off where asked
 * (SHARDSERVE_NO_AMX=1, or SHARDSERVE_FLOAT32_ACTIVATIONS=1, which keeps bfloat16 weights'
 * products and the cache in float32), where Linux refuses the tile state (arch_prctl), or where
 * one tile product of known numbers faults or comes out wrong (a virtual machine may list the
 * flags and refuse the instructions). The tile state belongs to the thread and other libraries
 * (oneDNN) use it too, so each call loads its configuration and releases the tiles when done.
 */
#ifndef SHARDSERVE_AMX_H
#define SHARDSERVE_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Whether the user asked for float32 activations against bfloat16 weights
 * (SHARDSERVE_FLOAT32_ACTIVATIONS=1): neither AMX tiles nor vdpbf16ps then, the float32 path
 * (and, as the model runner decides from bf16_path, a float32 KV cache). */
static int float32_activations_asked(void) {
    const char *v = getenv("SHARDSERVE_FLOAT32_ACTIVATIONS");
    return v && *v && strcmp(v, "0") != 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#include <setjmp.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_BUILT 1
#ifdef __AMX_INT8__
#define AMX_I8_BUILT 1
#else
#define AMX_I8_BUILT 0
#endif

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Every tile 16 rows of 64 bytes: 16 rows of 32 bfloat16 (A), 16 pair-rows of 16 lanes (B), or
 * 16 x 16 floats (accumulators). The products use tiles 0-3 as accumulators (2 activation tiles
 * x 2 groups), 4, 5 for activations and 6, 7 for weights; attention scores 0, 4 and 6. A
 * constant in memory, not a local: GCC's _tile_loadconfig tells the compiler it reads 8 bytes,
 * so at -O1 the stores filling a local's other 56 could be dropped. */
static const TileConfig amx_config = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

static inline void amx_configure(void) { _tile_loadconfig(&amx_config); }

static sigjmp_buf amx_probe_jump;
static void amx_probe_fault(int sig) { siglongjmp(amx_probe_jump, sig); }

/* One tile product of known numbers (`product`: 1 when its sums came out right), under a
 * handler: a virtual machine may list the flags and still fault on the instructions. Returns NULL
 * when it ran and was right, else why not (`wrong` where it ran and was not). It runs once, from
 * a library's constructor while dlopen loads it; the handlers are the process's for that moment,
 * so a fault in another thread then would land here (none of ours runs). */
static const char *amx_probe(int (*product)(void), const char *wrong) {
    struct sigaction fault, old_ill, old_segv;
    memset(&fault, 0, sizeof fault);
    fault.sa_handler = amx_probe_fault;
    sigemptyset(&fault.sa_mask);
    sigaction(SIGILL, &fault, &old_ill);
    sigaction(SIGSEGV, &fault, &old_segv);
    static const char *why;
    why = NULL;
    if (sigsetjmp(amx_probe_jump, 1) == 0) {
        if (!product()) why = wrong;
    } else {
        why = "the AMX instructions fault here (listed by the CPU, refused by the machine)";
    }
    sigaction(SIGILL, &old_ill, NULL);
    sigaction(SIGSEGV, &old_segv, NULL);
    return why;
}

/* 1.0 x 2.0 over 32 columns on bfloat16 tiles: every sum 64. */
static int amx_bf16_product(void) {
    uint16_t a[16 * 32], b[16 * 32];
    float c[16 * 16];
    for (int i = 0; i < 16 * 32; i++) {
        a[i] = 0x3F80; /* 1.0 */
        b[i] = 0x4000; /* 2.0 */
    }
    amx_configure();
    _tile_zero(0);
    _tile_loadd(4, a, 64);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_stored(0, c, 64);
    _tile_release();
    for (int i = 0; i < 16 * 16; i++)
        if (c[i] != 64.0f) return 0;
    return 1;
}

/* NULL where Linux grants this process the tile state and AMX was not turned off
 * (SHARDSERVE_NO_AMX), else why not. */
static const char *amx_permitted(void) {
    const char *off = getenv("SHARDSERVE_NO_AMX");
    if (off && *off && strcmp(off, "0") != 0) return "AMX off (SHARDSERVE_NO_AMX)";
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0)
        return "Linux refused the AMX tile state (arch_prctl)";
    return NULL;
}

/* NULL where this process runs AMX-BF16 tiles, else why not (see the top of this file). */
static const char *amx_decide(void) {
    if (float32_activations_asked()) return "AMX off (SHARDSERVE_FLOAT32_ACTIVATIONS)";
    const char *why = amx_permitted();
    return why ? why : amx_probe(amx_bf16_product, "the AMX probe's tile product came out wrong");
}

#else
#define AMX_BUILT 0
#define AMX_I8_BUILT 0
static inline const char *amx_decide(void) { return "this build has no AMX-BF16 (the compiler or the CPU lacks it)"; }
#endif
#endif
