/*
 * op_guard.c -- the priority-inversion guard. A demoted request that holds a lock others wait
 * for (SQLite's write lock, a PHP session file) makes them wait for it at its low priority,
 * whatever theirs: with SCHED_IDLE and busy normal threads, for as long as those keep the core.
 *
 * - Exemptions: requests of a method (OvertakePrioExemptMethods, 'unsafe' = all but GET and
 *   HEAD), under a URL path (OvertakePrioExemptPath) or carrying the exempt header (the sidecar
 *   sends it for a stage's exempt methods) keep their priority from start to end: no class
 *   level, no idle start at the gate, no age demotion.
 * - Demotion limit (OvertakePrioDemotionLimit): a request below its original priority for that
 *   long (wall time since its first demotion) gets its priority back for good, so a lock holder
 *   no rule foresaw finishes within the limit plus its own time at normal priority.
 * The pure parts are in op_guard_pure.c.
 */
#include "mod_overtake_prio.h"
#include "op_guard.h"

#include <string.h>
#include <strings.h>

#include "apr_strings.h"
#include "http_protocol.h"

struct op_guard_conf {
    int unsafe;                     /* every method but GET and HEAD is exempt */
    apr_array_header_t *methods;    /* const char *: exempt methods */
    apr_array_header_t *paths;      /* const char *: exempt URL path prefixes */
    const char *header;             /* exempt header, NULL = none */
    int header_set;
    double limit;                   /* OvertakePrioDemotionLimit, seconds; 0 = none */
};

typedef struct {
    apr_uint64_t seq;               /* the request (slot generation) `since` belongs to */
    int64_t since;                  /* when it first went below its original priority */
} op_guard_slot;

static op_guard_slot *guard_slots;  /* parallel to op_slots, in the child */
static int64_t limit_ns;            /* in the child */
/* in the child: no method or path rule, so only the header can exempt (the common case, where a
 * request start asks the header table once and nothing else), and the header's name or NULL */
static int header_only;
static const char *header_name;
static const char *const cause_names[OPG_CAUSES] = {"", "method", "path", "header"};

struct op_guard_conf *op_guard_create(apr_pool_t *p)
{
    struct op_guard_conf *g = apr_pcalloc(p, sizeof *g);
    g->methods = apr_array_make(p, 4, sizeof(const char *));
    g->paths = apr_array_make(p, 4, sizeof(const char *));
    return g;
}

/* Every guard directive is server-wide: guard_take checks that once, then hands the main
 * server's guard config to the setter named in the directive's cmd_data. */
typedef const char *(*guard_setter)(cmd_parms *cmd, struct op_guard_conf *g, const char *arg);

const char *op_guard_take(cmd_parms *cmd, void *d, const char *arg)
{
    const char *err = ap_check_cmd_context(cmd, GLOBAL_ONLY);
    op_conf *c = ap_get_module_config(cmd->server->module_config, &overtake_prio_module);
    guard_setter set = (guard_setter)cmd->info;
    (void)d;
    return err ? err : set(cmd, c->guard, arg);
}

const char *op_guard_set_methods(cmd_parms *cmd, struct op_guard_conf *g, const char *args)
{
    int n = 0;
    while (*args) {
        char *w = ap_getword_conf(cmd->temp_pool, &args);
        if (!*w) {
            break;
        }
        switch (op_guard_method_word(w)) {
        case OPG_WORD_UNSAFE:
            g->unsafe = 1;
            break;
        case OPG_WORD_METHOD:
            *(const char **)apr_array_push(g->methods) = apr_pstrdup(cmd->pool, w);
            break;
        default:
            return apr_psprintf(cmd->pool, "OvertakePrioExemptMethods: '%s' is not an HTTP "
                                "method (methods are upper case, e.g. POST) or 'unsafe' (every "
                                "method but GET and HEAD)", w);
        }
        n++;
    }
    return n ? NULL : "OvertakePrioExemptMethods: give one or more methods or 'unsafe', e.g. "
                      "OvertakePrioExemptMethods unsafe";
}

const char *op_guard_set_path(cmd_parms *cmd, struct op_guard_conf *g, const char *arg)
{
    if (!op_guard_path_ok(arg)) {
        return apr_psprintf(cmd->pool, "OvertakePrioExemptPath: '%s' must be a URL path that "
                            "starts with '/' and has no query, e.g. /api.php", arg);
    }
    *(const char **)apr_array_push(g->paths) = apr_pstrdup(cmd->pool, arg);
    return NULL;
}

const char *op_guard_set_header(cmd_parms *cmd, struct op_guard_conf *g, const char *arg)
{
    g->header = strcasecmp(arg, "none") ? apr_pstrdup(cmd->pool, arg) : NULL;
    g->header_set = 1;
    return NULL;
}

const char *op_guard_set_limit(cmd_parms *cmd, struct op_guard_conf *g, const char *arg)
{
    if (!op_parse_seconds(arg, 0.0, OP_GUARD_LIMIT_MAX, &g->limit)) {
        return apr_psprintf(cmd->pool, "OvertakePrioDemotionLimit: '%s' must be seconds in "
                            "[0, %g] (0: no limit), e.g. 0.5", arg, OP_GUARD_LIMIT_MAX);
    }
    return NULL;
}

static const char *guard_header(const struct op_guard_conf *g)
{
    return g->header_set ? g->header : "X-Overtake-Exempt";
}

int op_guard_cause(const request_rec *r)
{
    const struct op_guard_conf *g = op_cconf->guard;
    const char *h = guard_header(g);
    int k;
    if (!g->unsafe && !g->methods->nelts && !g->paths->nelts) {
        return h && apr_table_get(r->headers_in, h) ? OPG_BY_HEADER : OPG_NOT_EXEMPT;
    }
    if (op_guard_method_exempt(g->unsafe, (const char *const *)g->methods->elts,
                               g->methods->nelts, r->method)) {
        return OPG_BY_METHOD;
    }
    for (k = 0; k < g->paths->nelts && r->parsed_uri.path; k++) {
        if (op_guard_path_match(((const char **)g->paths->elts)[k], r->parsed_uri.path)) {
            return OPG_BY_PATH;
        }
    }
    return h && apr_table_get(r->headers_in, h) ? OPG_BY_HEADER : OPG_NOT_EXEMPT;
}

OP_HOT int op_guard_request(const request_rec *r)
{
    int cause = !header_only ? op_guard_cause(r)
                : header_name && apr_table_get(r->headers_in, header_name) ? OPG_BY_HEADER
                : OPG_NOT_EXEMPT;
    if (cause != OPG_NOT_EXEMPT) {
        ADD(op_shm->guard_exempt[cause], 1);
    }
    return cause != OPG_NOT_EXEMPT;
}

int op_guard_limited(void)
{
    return op_cconf->guard->limit > 0;
}

void op_guard_slots_create(apr_pool_t *p, int nslots)
{
    const struct op_guard_conf *g = op_cconf->guard;
    guard_slots = apr_pcalloc(p, sizeof *guard_slots * (apr_size_t)nslots);
    limit_ns = (int64_t)(g->limit * 1e9 + 0.5);
    header_only = !g->unsafe && !g->methods->nelts && !g->paths->nelts;
    header_name = guard_header(g);
}

int64_t op_guard_slot_due(op_slot *s, int64_t now, int64_t due)
{
    op_guard_slot *g;
    int release;
    /* an idle start before its admission is the gate's business: the sidecar promotes it */
    if (!limit_ns || s->level == 0 || s->gate_word) {
        return due;
    }
    g = &guard_slots[s - op_slots];
    if (g->seq != s->seq) {
        g->seq = s->seq;
        g->since = now;
    }
    due = op_guard_due(now, g->since, limit_ns, due, &release);
    if (release) {
        op_release(s);
        ADD(op_shm->guard_releases, 1);
        ap_log_error(APLOG_MARK, APLOG_DEBUG, 0, NULL, APLOGNO(90200) "mod_overtake_prio: "
                     "thread %ld below its priority for OvertakePrioDemotionLimit %g s: restored",
                     (long)s->tid, op_cconf->guard->limit);
    }
    return due;
}

void op_guard_status(request_rec *r, const op_conf *c)
{
    int k;
    ap_rputs("# HELP overtake_cpu_prio_demotion_limit_seconds Wall time a request may stay below "
             "its original priority (0: no limit).\n"
             "# TYPE overtake_cpu_prio_demotion_limit_seconds gauge\n", r);
    ap_rprintf(r, "overtake_cpu_prio_demotion_limit_seconds %.9g\n", c->guard->limit);
    if (!op_shm) {
        return;
    }
    ap_rputs("# HELP overtake_cpu_prio_exempt_total Requests never demoted because they may "
             "hold a lock, by the rule that exempted them.\n"
             "# TYPE overtake_cpu_prio_exempt_total counter\n", r);
    for (k = 1; k < OPG_CAUSES; k++) {
        ap_rprintf(r, "overtake_cpu_prio_exempt_total{cause=\"%s\"} %" APR_UINT64_T_FMT "\n",
                   cause_names[k], LOAD(op_shm->guard_exempt[k]));
    }
    ap_rputs("# HELP overtake_cpu_prio_limit_releases_total Demoted requests given their priority "
             "back by OvertakePrioDemotionLimit.\n"
             "# TYPE overtake_cpu_prio_limit_releases_total counter\n", r);
    ap_rprintf(r, "overtake_cpu_prio_limit_releases_total %" APR_UINT64_T_FMT "\n",
               LOAD(op_shm->guard_releases));
}
