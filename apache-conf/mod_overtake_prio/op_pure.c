/*
 * op_pure.c -- mod_overtake_prio's directive values and request headers, parsed without Apache
 * (see op_pure.h). The directives' error messages are written by their setters in
 * op_directives.c from the status returned here.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "op_pure.h"
#include "og_hmac.h"

int op_parse_seconds(const char *w, double lo, double hi, double *out)
{
    char *end;
    double v;
    errno = 0;
    v = strtod(w, &end);
    if (errno || end == w || *end || !(v >= lo && v <= hi)) {
        return 0;
    }
    *out = v;
    return 1;
}

int op_parse_long(const char *w, long lo, long hi, long *out)
{
    char *end;
    long v;
    errno = 0;
    v = strtol(w, &end, 10);
    if (errno || end == w || *end || v < lo || v > hi) {
        return 0;
    }
    *out = v;
    return 1;
}

static op_parse_status check_count(int n)
{
    if (n <= 0) {
        return OP_PARSE_EMPTY;
    }
    return n > OP_MAX_LEVELS ? OP_PARSE_TOO_MANY : OP_PARSE_OK;
}

op_parse_status op_parse_levels(const char *const *w, int n, double thr[OP_MAX_LEVELS], int *bad)
{
    op_parse_status st = check_count(n);
    int k;
    *bad = 0;
    for (k = 0; st == OP_PARSE_OK && k < n; k++) {
        *bad = k;
        if (!op_parse_seconds(w[k], 0.0, OP_THRESHOLD_MAX, &thr[k])) {
            st = OP_PARSE_RANGE;
        }
        else if (thr[k] <= 0.0 || (k > 0 && thr[k] <= thr[k - 1])) {
            st = OP_PARSE_ORDER;
        }
    }
    return st;
}

op_parse_status op_parse_nice(const char *const *w, int n, int nice[OP_MAX_LEVELS], int *bad)
{
    op_parse_status st = check_count(n);
    int k;
    *bad = 0;
    for (k = 0; st == OP_PARSE_OK && k < n; k++) {
        long v;
        *bad = k;
        if (k > 0 && nice[k - 1] == OP_NICE_IDLE) {
            st = OP_PARSE_IDLE_NOT_LAST;
        }
        else if (!strcasecmp(w[k], "idle")) {
            nice[k] = OP_NICE_IDLE;
        }
        else if (!op_parse_long(w[k], 1, 19, &v)) {
            st = OP_PARSE_RANGE;
        }
        else {
            nice[k] = (int)v;
            if (k > 0 && v < nice[k - 1]) {
                st = OP_PARSE_ORDER;
            }
        }
    }
    return st;
}

int op_parse_class(const char *h, int nlevels, int *out)
{
    char *end;
    long v;
    errno = 0;
    v = strtol(h, &end, 10);
    while (*end == ' ' || *end == '\t') {
        end++;
    }
    if (errno || end == h || *end || v < 0 || v > nlevels) {
        return 0;
    }
    *out = (int)v;
    return 1;
}

int op_parse_gate(const char *h, unsigned long *slot, unsigned long *gen,
                  uint8_t mac[OG_MAC_BYTES])
{
    char *end;
    if (*h < '0' || *h > '9') {
        return 0;
    }
    errno = 0;
    *slot = strtoul(h, &end, 10);
    if (errno || *end != ' ' || end[1] < '0' || end[1] > '9') {
        return 0;
    }
    h = end + 1;
    *gen = strtoul(h, &end, 10);
    if (errno || *end != ' ' || *gen > OG_GEN_MASK) {
        return 0;
    }
    h = end + 1;
    return strlen(h) == 2 * OG_MAC_BYTES && og_unhex(h, OG_MAC_BYTES, mac);
}
