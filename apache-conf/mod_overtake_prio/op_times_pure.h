/*
 * op_times_pure.h -- the parts of the request-time split (op_times.c) that need no Apache: reading
 * a line of /proc/thread-self/schedstat and splitting a request's wall time into CPU, run-queue
 * wait and blocked time. Plain C on libc only, checked with gcc alone
 * (tests/controller/harness/test_mod_times_pure.py).
 *
 * Why: under processor sharing a request's wall time is its CPU time plus the time it waited,
 * runnable, for a core. A request that waits for a lock (an fcntl lock, SQLite's busy-handler
 * sleeps) is off the CPU and not runnable: that is the blocked part, and a stage whose requests
 * are blocked only when another request of the same stage runs beside them is serialised.
 */
#ifndef OP_TIMES_PURE_H
#define OP_TIMES_PURE_H

#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)  /* only the module record is Apache's to see */

/* The three fields of /proc/<pid>/task/<tid>/schedstat (CONFIG_SCHED_INFO). */
typedef struct {
    int64_t cpu_ns;     /* time on a CPU (updated at ticks and switches: not exact while running) */
    int64_t wait_ns;    /* time runnable on a run queue, waiting for a CPU */
    int64_t slices;     /* timeslices run */
} op_schedstat;

/* Parse buf[0..n): three decimal integers separated by single spaces, then an optional newline
 * and nothing else. 1 on success, 0 (out untouched) on anything else, including a field above
 * INT64_MAX. */
int op_schedstat_parse(const char *buf, size_t n, op_schedstat *out);

/* A request's wall time split: blocked = wall - cpu - wait. The three are read from different
 * clocks (monotonic, the thread CPU clock, the scheduler's run-queue clock) at slightly different
 * instants, so a request that never blocked can come out a few microseconds below zero: that is
 * reported as 0. */
typedef struct {
    int64_t wall_ns;
    int64_t cpu_ns;
    int64_t wait_ns;
    int64_t blocked_ns;
} op_times_split_t;

/* 1 and *out set when wall, cpu and wait are all >= 0; 0 otherwise (a clock went backwards:
 * the request did not end on the thread it started on). */
int op_times_split(int64_t wall_ns, int64_t cpu_ns, int64_t wait_ns, op_times_split_t *out);

#pragma GCC visibility pop

#endif
