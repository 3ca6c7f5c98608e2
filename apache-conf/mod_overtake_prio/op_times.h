/*
 * op_times.h -- where a request's wall time went (op_times.c): its directive and hooks. Included
 * by the files that register them, after mod_overtake_prio.h.
 */
#ifndef OP_TIMES_H
#define OP_TIMES_H

#include "op_times_pure.h"

#pragma GCC visibility push(hidden)

extern int op_times_on;             /* OvertakeRequestTimes: reset at every config read */
void op_times_register_hooks(apr_pool_t *p);
/* Called by mod_overtake_prio.c's request start (after the gate) and insert_filter hooks. */
void op_times_start(request_rec *r);
void op_times_insert_filter(request_rec *r);

#define OP_TIMES_CMDS \
    AP_INIT_FLAG("OvertakeRequestTimes", op_global_flag, &op_times_on, RSRC_CONF, "On: split each request's time in its handler into CPU, run-queue wait and blocked time, as request notes overtake_cpu_us, overtake_wait_us, overtake_blocked_us, overtake_wall_us, overtake_start_us for the access log (default Off)")

#pragma GCC visibility pop

#endif
