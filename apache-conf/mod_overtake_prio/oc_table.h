/*
 * oc_table.h -- the control file's layout and its check: what the sidecar's policy chose, for the
 * module to apply without an edit of Apache's config (OvertakeControlFile, op_control.c).
 *
 * Written by the sidecar (controller/control_file.py), read here through a mapping. Plain C on
 * libc and og_hmac.h, so that the check runs on known answers without a server
 * (tests/controller/harness/test_mod_control.py).
 *
 * Layout, little-endian, a 64-byte head then 1 + STAGES rows of OC_ROW_BYTES:
 *   0  magic "OVTCTRL1"
 *   8  u32 generation: odd while the sidecar writes (a seqlock), even when the table is whole
 *   12 u32 stages      (0..OC_MAX_STAGES)
 *   16 u32 levels      (0: the policy chose no thresholds, the configured ones apply;
 *                       else the number of demoted levels, OvertakePrioLevels' count)
 *   20 u32 section     (0: none; 1: a stage section of version 1 follows the rows, os_table.h)
 *   24 u32 section bytes (0 without a section)
 *   28 u32 reserved    (0)
 *   32 HMAC-SHA256(key, bytes 0..31 of the head, then every row and the section), key from
 *      FILE.key
 * Row r (row 0: every request, whose stage Apache does not know; row 1 + i: stage i of the
 * sidecar's stages file):
 *   0  u32 flags: OC_FLAG_EXEMPT (bit 0) reserved for a per-stage demotion exemption, not acted
 *      on by this version; other bits must be 0
 *   4  u32 reserved (0)
 *   8  i64 threshold[OP_MAX_LEVELS]: thread-CPU nanoseconds at which level k+1 starts, the first
 *      `levels` > 0, strictly increasing, at most OP_THRESHOLD_MAX seconds; the rest 0
 */
#ifndef OC_TABLE_H
#define OC_TABLE_H

#include <stdint.h>
#include <string.h>

#include "og_hmac.h"
#include "op_pure.h"
#include "os_table.h"

#define OC_MAGIC "OVTCTRL1"
#define OC_HEAD_BYTES 64
#define OC_ROW_BYTES (8 + 8 * OP_MAX_LEVELS)
#define OC_MAX_STAGES 255
#define OC_MAX_BYTES (OC_HEAD_BYTES + (1 + OC_MAX_STAGES) * OC_ROW_BYTES)
#define OC_FILE_MAX_BYTES (OC_MAX_BYTES + OS_MAX_BYTES)  /* with the largest stage section */
#define OC_SECTION_STAGES 1u
#define OC_GEN_OFFSET 8
#define OC_FLAG_EXEMPT 1u

typedef struct {
    uint32_t flags;
    int64_t thr_ns[OP_MAX_LEVELS];
} oc_row;

/* A checked table. */
typedef struct {
    uint32_t generation;
    uint32_t stages;
    uint32_t levels;
    oc_row rows[1 + OC_MAX_STAGES];
    uint32_t section;           /* 0: no stage section; OC_SECTION_STAGES: counts holds it */
    os_table counts;
} oc_table;

/* Why a file's bytes are refused (OC_OK: accepted). */
typedef enum {
    OC_OK = 0,
    OC_SHORT,        /* shorter than the head */
    OC_MAGIC_BAD,    /* not OVTCTRL1: another file, or a sidecar of another version */
    OC_BUSY,         /* odd generation: the sidecar is writing it */
    OC_STAGES,       /* more stages than OC_MAX_STAGES */
    OC_SIZE,         /* the size is not the head plus 1 + stages rows */
    OC_LEVELS,       /* levels not 0 and not the configured count */
    OC_MAC,          /* not written with this server's key, or changed since */
    OC_FLAGS,        /* an unknown flag bit, or a reserved field not 0 */
    OC_THRESHOLDS,   /* a threshold out of (0, OP_THRESHOLD_MAX], not increasing, or trailing */
    OC_SECTION       /* an unknown section version, or a section os_check refuses */
} oc_status;

static inline uint32_t oc_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline int64_t oc_i64(const uint8_t *p)
{
    return (int64_t)((uint64_t)oc_u32(p) | (uint64_t)oc_u32(p + 4) << 32);
}

/* One line for an oc_status, for the log. */
static inline const char *oc_reason(oc_status st)
{
    switch (st) {
    case OC_OK: return "accepted";
    case OC_SHORT: return "it is shorter than a control file's head (empty: no sidecar has written it yet)";
    case OC_MAGIC_BAD: return "it has no " OC_MAGIC " head (not written by a sidecar of this version)";
    case OC_BUSY: return "the sidecar is writing it";
    case OC_STAGES: return "it names more stages than the module takes";
    case OC_SIZE: return "its size does not match its stage count";
    case OC_LEVELS: return "its level count is not the configured one (OvertakePrioLevels: give as "
                           "many thresholds as the sidecar's policy chooses)";
    case OC_MAC: return "it was not written with this server's key (FILE.key), or it changed while read";
    case OC_FLAGS: return "a row has an unknown flag or a reserved field set";
    case OC_THRESHOLDS: return "a threshold is not > 0, increasing and at most 3600 s";
    case OC_SECTION: return "its stage section is of an unknown version or malformed";
    }
    return "unknown";
}

/* Check the n bytes at b (a copy of the file) against the configured level count and the key;
 * on OC_OK fill *t. The MAC is checked before any field it covers is trusted. */
static inline oc_status oc_check(const uint8_t *b, size_t n, uint32_t conf_levels,
                                 const og_hmac_key *key, oc_table *t)
{
    uint8_t mac[32];
    uint32_t stages, levels, r, section, sbytes;
    size_t rows_end;
    if (n < OC_HEAD_BYTES) {
        return OC_SHORT;
    }
    if (memcmp(b, OC_MAGIC, 8)) {
        return OC_MAGIC_BAD;
    }
    if (oc_u32(b + OC_GEN_OFFSET) & 1u) {
        return OC_BUSY;
    }
    stages = oc_u32(b + 12);
    levels = oc_u32(b + 16);
    section = oc_u32(b + 20);
    sbytes = oc_u32(b + 24);
    if (stages > OC_MAX_STAGES) {
        return OC_STAGES;
    }
    rows_end = OC_HEAD_BYTES + (size_t)(1 + stages) * OC_ROW_BYTES;
    if (sbytes > OS_MAX_BYTES || n != rows_end + sbytes) {
        return OC_SIZE;
    }
    {
        og_sha256 c = key->inner;  /* the MAC of two pieces: the head's first half, the rows */
        og_sha256_update(&c, b, 32);
        og_sha256_update(&c, b + OC_HEAD_BYTES, n - OC_HEAD_BYTES);
        og_sha256_final(&c, mac);
        c = key->outer;
        og_sha256_update(&c, mac, 32);
        og_sha256_final(&c, mac);
    }
    if (!og_equal(mac, b + 32, 32)) {
        return OC_MAC;
    }
    if (levels != 0 && levels != conf_levels) {
        return OC_LEVELS;
    }
    if (oc_u32(b + 28)) {
        return OC_FLAGS;
    }
    if (section > OC_SECTION_STAGES || (section == 0) != (sbytes == 0)) {
        return OC_SECTION;
    }
    if (section && os_check(b + rows_end, sbytes, &t->counts) != OS_OK) {
        return OC_SECTION;
    }
    for (r = 0; r <= stages; r++) {
        const uint8_t *row = b + OC_HEAD_BYTES + (size_t)r * OC_ROW_BYTES;
        uint32_t k;
        if ((oc_u32(row) & ~OC_FLAG_EXEMPT) || oc_u32(row + 4)) {
            return OC_FLAGS;
        }
        t->rows[r].flags = oc_u32(row);
        for (k = 0; k < OP_MAX_LEVELS; k++) {
            int64_t v = oc_i64(row + 8 + 8 * k);
            if (k < levels ? v <= 0 || v > (int64_t)(OP_THRESHOLD_MAX * 1e9)
                                 || (k && v <= t->rows[r].thr_ns[k - 1])
                           : v != 0) {
                return OC_THRESHOLDS;
            }
            t->rows[r].thr_ns[k] = v;
        }
    }
    t->generation = oc_u32(b + OC_GEN_OFFSET);
    t->section = section;
    t->stages = stages;
    t->levels = levels;
    return OC_OK;
}

#endif
