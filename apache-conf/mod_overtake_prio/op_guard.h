/*
 * op_guard.h -- the priority-inversion guard (op_guard.c): exempt requests are never demoted,
 * and a demoted request gets its priority back after OvertakePrioDemotionLimit. Included by the
 * files that call it after mod_overtake_prio.h.
 */
#ifndef OP_GUARD_H
#define OP_GUARD_H

#include "op_guard_pure.h"

#pragma GCC visibility push(hidden)

/* Why a request is exempt (the cause label of overtake_cpu_prio_exempt_total). */
enum { OPG_NOT_EXEMPT = 0, OPG_BY_METHOD, OPG_BY_PATH, OPG_BY_HEADER, OPG_CAUSES };

struct op_guard_conf *op_guard_create(apr_pool_t *p);
const char *op_guard_take(cmd_parms *cmd, void *d, const char *arg);
const char *op_guard_set_methods(cmd_parms *cmd, struct op_guard_conf *g, const char *args);
const char *op_guard_set_path(cmd_parms *cmd, struct op_guard_conf *g, const char *arg);
const char *op_guard_set_header(cmd_parms *cmd, struct op_guard_conf *g, const char *arg);
const char *op_guard_set_limit(cmd_parms *cmd, struct op_guard_conf *g, const char *arg);

/* cmd_data is the setter: a function pointer passed as the directive's void * (POSIX). */
#define OP_GUARD_CMDS \
    AP_INIT_RAW_ARGS("OvertakePrioExemptMethods", op_guard_take, (void *)op_guard_set_methods, RSRC_CONF, "requests of these methods are never demoted ('unsafe': every method but GET and HEAD; default none)"), \
    AP_INIT_ITERATE("OvertakePrioExemptPath", op_guard_take, (void *)op_guard_set_path, RSRC_CONF, "requests under these URL paths are never demoted (default none)"), \
    AP_INIT_TAKE1("OvertakePrioExemptHeader", op_guard_take, (void *)op_guard_set_header, RSRC_CONF, "requests carrying this header are never demoted (default X-Overtake-Exempt, sent by the sidecar for a stage's exempt methods; 'none' to ignore)"), \
    AP_INIT_TAKE1("OvertakePrioDemotionLimit", op_guard_take, (void *)op_guard_set_limit, RSRC_CONF, "seconds a request may stay below its original priority before it gets it back for good (default 0: no limit)")

/* The exemption cause of r (OPG_NOT_EXEMPT if none). */
int op_guard_cause(const request_rec *r);
/* Same, counted in the shared counters: called once per request, at its start. */
int op_guard_request(const request_rec *r);
/* The monitor is needed for the limit even without age priority. */
int op_guard_limited(void);
/* Per-slot state of the limit, one entry per slot of op_slots, and the exemption rules' shape
 * (child_init). */
void op_guard_slots_create(apr_pool_t *p, int nslots);
/* The due time of slot s under the limit (caller holds s->mu): see op_guard_due; a request past
 * its limit is given its priority back here and never demoted again. */
int64_t op_guard_slot_due(op_slot *s, int64_t now, int64_t due);
/* Its lines on the status page. */
void op_guard_status(request_rec *r, const op_conf *c);

#pragma GCC visibility pop

#endif
