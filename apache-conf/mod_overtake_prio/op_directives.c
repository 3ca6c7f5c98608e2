/*
 * op_directives.c -- mod_overtake_prio's directives: the server config and its setters.
 * The values are parsed by op_pure.c; the messages that name a refused value are written here.
 */
#include "mod_overtake_prio.h"
#include "op_guard.h"
#include "op_times.h"
#include "op_stage.h"

#include <string.h>
#include <strings.h>

#include "apr_strings.h"
#include "http_config.h"

void *op_create_server_conf(apr_pool_t *p, server_rec *s)
{
    op_conf *c = apr_pcalloc(p, sizeof *c);
    (void)s;
    c->enabled = OP_UNSET;
    c->interval = OP_UNSET;
    c->resolution = OP_UNSET;
    c->age = OP_UNSET;
    c->rlimit_nice = OP_UNSET;
    c->gate_timeout = OP_UNSET;
    c->guard = op_guard_create(p);
    return c;
}

/* Every directive is server-wide. take_word and take_flag check that once, then hand the main
 * server's config to the setter the directive names in its cmd_data (an op_directive). */
typedef const char *(*op_setter)(cmd_parms *cmd, op_conf *c, const char *arg);
typedef struct {
    op_setter set;
    size_t field;               /* set_flag: offset of the int it sets in op_conf */
} op_directive;

static const char *take_word(cmd_parms *cmd, void *d, const char *arg)
{
    const char *err = ap_check_cmd_context(cmd, GLOBAL_ONLY);
    const op_directive *dir = cmd->info;
    (void)d;
    if (err) {
        return err;
    }
    return dir->set(cmd, ap_get_module_config(cmd->server->module_config, &overtake_prio_module),
                    arg);
}

static const char *take_flag(cmd_parms *cmd, void *d, int on)
{
    return take_word(cmd, d, on ? "On" : "Off");
}

/* A server-wide On|Off kept in a global of the file that reads it (the directive's cmd_data). */
const char *op_global_flag(cmd_parms *cmd, void *d, int on)
{
    const char *err = ap_check_cmd_context(cmd, GLOBAL_ONLY);
    (void)d;
    if (err) {
        return err;
    }
    *(int *)cmd->info = on;
    return NULL;
}

static const char *set_flag(cmd_parms *cmd, op_conf *c, const char *arg)
{
    const op_directive *dir = cmd->info;
    *(int *)((char *)c + dir->field) = !strcmp(arg, "On");
    return NULL;
}

static const char *seconds_error(apr_pool_t *p, const char *name, const char *w, double lo,
                                 double hi)
{
    return apr_psprintf(p, "%s: '%s' must be seconds in [%g, %g], e.g. 0.005", name, w, lo, hi);
}

static const char *parse_seconds(apr_pool_t *p, const char *name, const char *w,
                                 double lo, double hi, double *out)
{
    return op_parse_seconds(w, lo, hi, out) ? NULL : seconds_error(p, name, w, lo, hi);
}

/* The words of a per-level directive: as many as OP_MAX_LEVELS + 1 (one more is refused). */
static int split_levels(cmd_parms *cmd, const char *args, const char **words)
{
    int n = 0;
    while (*args && n <= OP_MAX_LEVELS) {
        char *w = ap_getword_conf(cmd->temp_pool, &args);
        if (!*w) {
            break;
        }
        words[n++] = w;
    }
    return n;
}

/* The message of a word count a per-level directive refuses, NULL if the count is good. */
static const char *count_error(cmd_parms *cmd, op_parse_status st, const char *usage)
{
    if (st == OP_PARSE_EMPTY) {
        return usage;
    }
    if (st == OP_PARSE_TOO_MANY) {
        return apr_psprintf(cmd->pool, "%s: at most %d levels", cmd->cmd->name, OP_MAX_LEVELS);
    }
    return NULL;
}

static const char *set_levels(cmd_parms *cmd, op_conf *c, const char *args)
{
    const char *w[OP_MAX_LEVELS + 1];
    int n = split_levels(cmd, args, w), bad;
    op_parse_status st = op_parse_levels(w, n, c->threshold, &bad);
    const char *err = count_error(cmd, st, "OvertakePrioLevels: give one or more thread-CPU "
                                  "thresholds in seconds, e.g. OvertakePrioLevels 0.005 0.05");
    if (st == OP_PARSE_RANGE) {
        err = seconds_error(cmd->pool, "OvertakePrioLevels", w[bad], 0.0, OP_THRESHOLD_MAX);
    }
    else if (st == OP_PARSE_ORDER) {
        err = apr_psprintf(cmd->pool, "OvertakePrioLevels: thresholds must be > 0 and "
                           "strictly increasing, got %s after %g", w[bad],
                           bad ? c->threshold[bad - 1] : 0.0);
    }
    c->nlevels = err ? 0 : n;
    return err;
}

static const char *set_nice(cmd_parms *cmd, op_conf *c, const char *args)
{
    const char *w[OP_MAX_LEVELS + 1];
    int n = split_levels(cmd, args, w), bad;
    op_parse_status st = op_parse_nice(w, n, c->nice, &bad);
    const char *err = count_error(cmd, st, "OvertakePrioNice: give one nice increment (1..19) "
                                  "or 'idle' per level, e.g. OvertakePrioNice 10 idle");
    if (st == OP_PARSE_IDLE_NOT_LAST) {
        return "OvertakePrioNice: 'idle' (SCHED_IDLE) can only be the last level";
    }
    if (st == OP_PARSE_RANGE) {
        return apr_psprintf(cmd->pool, "OvertakePrioNice: '%s' must be a nice increment "
                            "in 1..19 or 'idle', e.g. OvertakePrioNice 10 idle", w[bad]);
    }
    if (st == OP_PARSE_ORDER) {
        return apr_psprintf(cmd->pool, "OvertakePrioNice: levels must not rise in "
                            "priority, got nice %ld after %d", (long)c->nice[bad],
                            c->nice[bad - 1]);
    }
    c->nnice = err ? 0 : n;
    return err;
}

static const char *set_interval(cmd_parms *cmd, op_conf *c, const char *w)
{
    return parse_seconds(cmd->pool, "OvertakePrioInterval", w, 0.0001, 1.0, &c->interval);
}

static const char *set_resolution(cmd_parms *cmd, op_conf *c, const char *w)
{
    return parse_seconds(cmd->pool, "OvertakePrioCpuResolution", w, 0.0, 0.1, &c->resolution);
}

static const char *set_header(cmd_parms *cmd, op_conf *c, const char *w)
{
    c->class_header = strcasecmp(w, "none") ? apr_pstrdup(cmd->pool, w) : NULL;
    c->class_header_set = 1;
    return NULL;
}

static const char *set_cap(cmd_parms *cmd, op_conf *c, const char *w)
{
    static const char *const names[] = {"auto", "on", "off"};  /* indexed by OP_CAP_* */
    int k;
    for (k = 0; k < 3; k++) {
        if (!strcasecmp(w, names[k])) {
            c->cap_sys_nice = k;
            return NULL;
        }
    }
    return apr_psprintf(cmd->pool, "OvertakePrioCapSysNice: '%s' must be auto, on or off", w);
}

static const char *set_rlimit(cmd_parms *cmd, op_conf *c, const char *w)
{
    long v;
    if (!op_parse_long(w, 0, 40, &v)) {
        return apr_psprintf(cmd->pool, "OvertakePrioRlimitNice: '%s' must be in 0..40 "
                            "(20 lets a thread return to nice 0)", w);
    }
    c->rlimit_nice = (int)v;
    return NULL;
}

static const char *set_gate_file(cmd_parms *cmd, op_conf *c, const char *w)
{
    if (w[0] != '/') {
        return apr_psprintf(cmd->pool, "OvertakeGate: '%s' must be an absolute path, the file "
                            "the sidecar's --gate option names (e.g. /dev/shm/overtake-gate)", w);
    }
    c->gate_file = apr_pstrdup(cmd->pool, w);
    return NULL;
}

static const char *set_gate_header(cmd_parms *cmd, op_conf *c, const char *w)
{
    c->gate_header = apr_pstrdup(cmd->pool, w);
    return NULL;
}

static const char *set_gate_timeout(cmd_parms *cmd, op_conf *c, const char *w)
{
    return parse_seconds(cmd->pool, "OvertakeGateTimeout", w, 0.001, 3600.0, &c->gate_timeout);
}

static const char *set_control_file(cmd_parms *cmd, op_conf *c, const char *w)
{
    if (w[0] != '/') {
        return apr_psprintf(cmd->pool, "OvertakeControlFile: '%s' must be an absolute path, the "
                            "file the sidecar's control_file names (e.g. "
                            "/run/overtake/control)", w);
    }
    c->control_file = apr_pstrdup(cmd->pool, w);
    return NULL;
}

static op_directive dir_enabled = {set_flag, APR_OFFSETOF(op_conf, enabled)};
static op_directive dir_age = {set_flag, APR_OFFSETOF(op_conf, age)};
static op_directive dir_levels = {set_levels, 0};
static op_directive dir_nice = {set_nice, 0};
static op_directive dir_interval = {set_interval, 0};
static op_directive dir_header = {set_header, 0};
static op_directive dir_resolution = {set_resolution, 0};
static op_directive dir_rlimit = {set_rlimit, 0};
static op_directive dir_cap = {set_cap, 0};
static op_directive dir_gate_file = {set_gate_file, 0};
static op_directive dir_gate_header = {set_gate_header, 0};
static op_directive dir_gate_timeout = {set_gate_timeout, 0};
static op_directive dir_control_file = {set_control_file, 0};

const command_rec op_cmds[] = {
    AP_INIT_FLAG("OvertakePrio", take_flag, &dir_enabled, RSRC_CONF, "On: lower worker-thread CPU priority per request (default Off)"),
    AP_INIT_RAW_ARGS("OvertakePrioLevels", take_word, &dir_levels, RSRC_CONF, "thread-CPU seconds at which a request enters level 1, 2, ... (default 0.005 0.05)"),
    AP_INIT_RAW_ARGS("OvertakePrioNice", take_word, &dir_nice, RSRC_CONF, "priority of level 1, 2, ...: nice increment 1..19 over the thread's own nice, or 'idle' (SCHED_IDLE) last (default 10 ... idle)"),
    AP_INIT_TAKE1("OvertakePrioInterval", take_word, &dir_interval, RSRC_CONF, "monitor period in seconds (default 0.001)"),
    AP_INIT_TAKE1("OvertakePrioCpuResolution", take_word, &dir_resolution, RSRC_CONF, "a worker reads its thread CPU clock at most once per this many seconds; attained CPU is overcounted by less (default 0.001; 0: at every request)"),
    AP_INIT_FLAG("OvertakePrioAge", take_flag, &dir_age, RSRC_CONF, "On: demote by attained thread CPU (default); Off: class header only"),
    AP_INIT_TAKE1("OvertakePrioClassHeader", take_word, &dir_header, RSRC_CONF, "request header giving the starting level (default X-Overtake-Class; 'none' to ignore)"),
    AP_INIT_TAKE1("OvertakePrioRlimitNice", take_word, &dir_rlimit, RSRC_CONF, "RLIMIT_NICE set before Apache switches user (default 20: back to nice 0)"),
    AP_INIT_TAKE1("OvertakePrioCapSysNice", take_word, &dir_cap, RSRC_CONF, "keep CAP_SYS_NICE (only) across the switch to the worker user: auto (when RLIMIT_NICE cannot allow the restore; default), on, off"),
    AP_INIT_TAKE1("OvertakeGate", take_word, &dir_gate_file, RSRC_CONF, "file of the sidecar's admission gate (its --gate): requests with the gate header wait there until the sidecar admits them (default: no gate)"),
    AP_INIT_TAKE1("OvertakeGateHeader", take_word, &dir_gate_header, RSRC_CONF, "request header with a gated request's slot and generation (default X-Overtake-Gate)"),
    AP_INIT_TAKE1("OvertakeGateTimeout", take_word, &dir_gate_timeout, RSRC_CONF, "seconds a request waits at a gate that never opens before it is let through (default 60; keep above the sidecar's queue timeout)"),
    OP_GUARD_CMDS,
    OP_TIMES_CMDS,
    AP_INIT_TAKE1("OvertakeStage", op_stage_set, NULL, ACCESS_CONF, "the stage of the requests matched by this <Location>, <LocationMatch> or <If> (a name of the sidecar's stages file; 'none': no stage); the control file's count table holds them"),
    AP_INIT_TAKE23("OvertakeStagePrefix", op_stage_set_prefix, NULL, RSRC_CONF, "PREFIX STAGE [METHOD]: requests whose URL path starts with PREFIX (at a segment boundary, as <Location>; the longest prefix wins; METHOD: only that method) are of STAGE ('none': of no stage); an OvertakeStage section wins over it"),
    AP_INIT_TAKE1("OvertakeStageHold", op_stage_set_hold, NULL, RSRC_CONF, "seconds a request waits at most for its stage's turn before it runs anyway (default 30)"),
    AP_INIT_TAKE2("OvertakeStageNext", op_stage_set_next, NULL, RSRC_CONF, "FIRST SECOND: a request of stage FIRST that ends on a kept-alive connection reserves a turn of stage SECOND for the connection's next request (default: none)"),
    AP_INIT_FLAG("OvertakeStageAbortOnClose", op_global_flag, &os_abort_on_close, RSRC_CONF, "Off: a held request whose client half-closed the connection is served (it may still read its answer); On: dropped, as one whose client reset it always is (default On)"),
    AP_INIT_TAKE1("OvertakeStageLifoAfter", op_stage_set_lifo_after, NULL, RSRC_CONF, "seconds a stage's queue stands (never empty) before its starts go to the newest waiting requests first, until it empties (default 0: always the oldest first)"),
    AP_INIT_TAKE1("OvertakeStageFollowUp", op_stage_set_follow_up, NULL, RSRC_CONF, "seconds a follow-up reservation waits for the connection's next request before it is given up (default 0.005)"),
    AP_INIT_TAKE1("OvertakeControlFile", take_word, &dir_control_file, RSRC_CONF, "file the sidecar writes the age thresholds of its policy to (its control_file): they replace OvertakePrioLevels while the file is valid, without a restart (default: none)"),
    {NULL}
};
