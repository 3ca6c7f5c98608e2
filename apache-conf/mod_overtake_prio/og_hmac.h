/*
 * og_hmac.h -- HMAC-SHA256 (RFC 2104, FIPS 180-4) for the admission gate's header MACs.
 *
 * The sidecar signs each gated request's "SLOT GENERATION" with a key that only it and Apache
 * hold, so that a client reaching Apache directly cannot park a worker on a slot it read or
 * guessed. Self-contained (APR has SHA-1 only; apr_crypto needs a driver); the key's inner and
 * outer pad states are hashed once (og_hmac_init), so a request costs two compressions.
 * Checked against RFC 4231's vectors by tests/controller/harness/test_gate_hmac.py.
 */
#ifndef OG_HMAC_H
#define OG_HMAC_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint32_t h[8];
    uint64_t bytes;             /* hashed so far */
    uint8_t buf[64];
    size_t n;                   /* bytes in buf */
} og_sha256;

typedef struct {
    og_sha256 inner;            /* after key ^ ipad */
    og_sha256 outer;            /* after key ^ opad */
} og_hmac_key;

static const uint32_t og_sha256_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

#define OG_ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static inline void og_sha256_block(og_sha256 *c, const uint8_t *p)
{
    uint32_t w[64], a, b, d, e, f, g, h, cc, t1, t2;
    int i;
    for (i = 0; i < 16; i++) {
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16
               | (uint32_t)p[4 * i + 2] << 8 | (uint32_t)p[4 * i + 3];
    }
    for (i = 16; i < 64; i++) {
        uint32_t s0 = OG_ROR(w[i - 15], 7) ^ OG_ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = OG_ROR(w[i - 2], 17) ^ OG_ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = c->h[0]; b = c->h[1]; cc = c->h[2]; d = c->h[3];
    e = c->h[4]; f = c->h[5]; g = c->h[6]; h = c->h[7];
    for (i = 0; i < 64; i++) {
        t1 = h + (OG_ROR(e, 6) ^ OG_ROR(e, 11) ^ OG_ROR(e, 25)) + ((e & f) ^ (~e & g))
             + og_sha256_k[i] + w[i];
        t2 = (OG_ROR(a, 2) ^ OG_ROR(a, 13) ^ OG_ROR(a, 22)) + ((a & b) ^ (a & cc) ^ (b & cc));
        h = g; g = f; f = e; e = d + t1;
        d = cc; cc = b; b = a; a = t1 + t2;
    }
    c->h[0] += a; c->h[1] += b; c->h[2] += cc; c->h[3] += d;
    c->h[4] += e; c->h[5] += f; c->h[6] += g; c->h[7] += h;
}

static inline void og_sha256_init(og_sha256 *c)
{
    static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(c->h, iv, sizeof iv);
    c->bytes = 0;
    c->n = 0;
}

static inline void og_sha256_update(og_sha256 *c, const void *data, size_t len)
{
    const uint8_t *p = data;
    c->bytes += len;
    while (len) {
        size_t take = 64 - c->n < len ? 64 - c->n : len;
        memcpy(c->buf + c->n, p, take);
        c->n += take;
        p += take;
        len -= take;
        if (c->n == 64) {
            og_sha256_block(c, c->buf);
            c->n = 0;
        }
    }
}

static inline void og_sha256_final(og_sha256 *c, uint8_t out[32])
{
    uint64_t bits = c->bytes * 8;
    int i;
    c->buf[c->n++] = 0x80;
    if (c->n > 56) {
        memset(c->buf + c->n, 0, 64 - c->n);
        og_sha256_block(c, c->buf);
        c->n = 0;
    }
    memset(c->buf + c->n, 0, 56 - c->n);
    for (i = 0; i < 8; i++) {
        c->buf[56 + i] = (uint8_t)(bits >> (56 - 8 * i));
    }
    og_sha256_block(c, c->buf);
    for (i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(c->h[i] >> 24);
        out[4 * i + 1] = (uint8_t)(c->h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(c->h[i] >> 8);
        out[4 * i + 3] = (uint8_t)c->h[i];
    }
}

/* The pad states of `key` (a key longer than a block is hashed first, RFC 2104). */
static inline void og_hmac_init(og_hmac_key *k, const uint8_t *key, size_t len)
{
    uint8_t block[64], pad[64];
    int i;
    memset(block, 0, sizeof block);
    if (len > 64) {
        og_sha256 c;
        og_sha256_init(&c);
        og_sha256_update(&c, key, len);
        og_sha256_final(&c, block);
    }
    else {
        memcpy(block, key, len);
    }
    for (i = 0; i < 64; i++) {
        pad[i] = block[i] ^ 0x36;
    }
    og_sha256_init(&k->inner);
    og_sha256_update(&k->inner, pad, 64);
    for (i = 0; i < 64; i++) {
        pad[i] = block[i] ^ 0x5c;
    }
    og_sha256_init(&k->outer);
    og_sha256_update(&k->outer, pad, 64);
    memset(block, 0, sizeof block);
    memset(pad, 0, sizeof pad);
}

static inline void og_hmac(const og_hmac_key *k, const void *msg, size_t len, uint8_t out[32])
{
    og_sha256 c = k->inner;
    uint8_t inner[32];
    og_sha256_update(&c, msg, len);
    og_sha256_final(&c, inner);
    c = k->outer;
    og_sha256_update(&c, inner, 32);
    og_sha256_final(&c, out);
}

/* 1 if the n bytes are equal; the time does not depend on where they differ. */
static inline int og_equal(const uint8_t *a, const uint8_t *b, size_t n)
{
    volatile uint8_t diff = 0;
    size_t i;
    for (i = 0; i < n; i++) {
        diff |= a[i] ^ b[i];
    }
    return diff == 0;
}

/* Lower-case hex of n bytes (out holds 2n + 1). */
static inline void og_hex(const uint8_t *p, size_t n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    size_t i;
    for (i = 0; i < n; i++) {
        out[2 * i] = digits[p[i] >> 4];
        out[2 * i + 1] = digits[p[i] & 15];
    }
    out[2 * n] = 0;
}

/* n bytes from exactly 2n hex digits (either case) at s; 0 on anything else. */
static inline int og_unhex(const char *s, size_t n, uint8_t *out)
{
    size_t i;
    for (i = 0; i < 2 * n; i++) {
        char ch = s[i];
        int v = ch >= '0' && ch <= '9' ? ch - '0'
                : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
                : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10 : -1;
        if (v < 0) {
            return 0;
        }
        if (i % 2) {
            out[i / 2] = (uint8_t)(out[i / 2] << 4 | v);
        }
        else {
            out[i / 2] = (uint8_t)v;
        }
    }
    return 1;
}

#endif
