/*
 * op_times_pure.c -- a schedstat line and the split of a request's wall time, without Apache (see
 * op_times_pure.h).
 */
#include "op_times_pure.h"

/* One decimal field at *p (at most INT64_MAX), advancing *p past it. */
static int parse_field(const char **p, const char *end, int64_t *v)
{
    int64_t x = 0;
    const char *q = *p;
    if (q == end || *q < '0' || *q > '9') {
        return 0;
    }
    for (; q < end && *q >= '0' && *q <= '9'; q++) {
        int d = *q - '0';
        if (x > (INT64_MAX - d) / 10) {
            return 0;
        }
        x = x * 10 + d;
    }
    *v = x;
    *p = q;
    return 1;
}

int op_schedstat_parse(const char *buf, size_t n, op_schedstat *out)
{
    const char *p = buf, *end = buf + n;
    int64_t f[3];
    int k;
    for (k = 0; k < 3; k++) {
        if (k > 0) {
            if (p == end || *p != ' ') {
                return 0;
            }
            p++;
        }
        if (!parse_field(&p, end, &f[k])) {
            return 0;
        }
    }
    if (p < end && *p == '\n') {
        p++;
    }
    if (p != end) {
        return 0;
    }
    out->cpu_ns = f[0];
    out->wait_ns = f[1];
    out->slices = f[2];
    return 1;
}

int op_times_split(int64_t wall_ns, int64_t cpu_ns, int64_t wait_ns, op_times_split_t *out)
{
    int64_t blocked;
    if (wall_ns < 0 || cpu_ns < 0 || wait_ns < 0) {
        return 0;
    }
    blocked = wall_ns - cpu_ns - wait_ns;
    out->wall_ns = wall_ns;
    out->cpu_ns = cpu_ns;
    out->wait_ns = wait_ns;
    out->blocked_ns = blocked > 0 ? blocked : 0;
    return 1;
}
