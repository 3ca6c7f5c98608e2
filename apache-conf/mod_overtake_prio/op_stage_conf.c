/*
 * op_stage_conf.c -- which request is of which stage (module mode), and the stage directives.
 *
 * Two ways to name a request's stage:
 *   - `OvertakeStage NAME` in a <Location>, <LocationMatch>, <Directory> or <If> section: Apache's
 *     own matching, so methods and query strings select stages through <If> expressions. Apache
 *     merges the matching sections' configs per request (and runs a <LocationMatch>'s regex):
 *     on a tiny static request that is a visible share of its cost.
 *   - `OvertakeStagePrefix PREFIX NAME [METHOD]` at server or virtual-host level: a literal path
 *     prefix, ending at a segment boundary as a <Location> path does (/static covers /static and
 *     /static/..., not /statics); the longest prefix wins, and of two equal prefixes the one
 *     naming the request's method. Matched in the module's own fixups hook by a plain compare of
 *     the request's path against a list sorted once at start: no section, no merge, no regex.
 *     A virtual host sees the main server's prefixes and its own; its own replace the main
 *     server's of the same prefix and method. `NAME` none takes a subtree out of a shorter prefix.
 * A section's OvertakeStage (none included) wins over every prefix: a section is the place for
 * what a prefix cannot say (a pattern, a query string, an expression). The same prefix and method
 * twice in one server's config is refused at start (AH90304), naming both lines.
 */
#include "mod_overtake_prio.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "apr_strings.h"

#include "op_stage.h"

/* The names of the config being read (reset by pre_config: Apache reads its config twice). */
char os_names[OS_MAX_STAGES][OS_NAME_BYTES];
int os_nnames;
double os_hold_s = 30.0;            /* OvertakeStageHold */
int os_next[OS_MAX_STAGES];         /* OvertakeStageNext of the config being read (-1: none) */
double os_follow_s = 0.005;         /* OvertakeStageFollowUp: about a loopback client's round trip */
int os_abort_on_close = 1;          /* OvertakeStageAbortOnClose */
double os_lifo_s;                   /* OvertakeStageLifoAfter (0: off) */

typedef struct {
    int stage;                      /* shared stage index, OS_NONE or OS_UNSET */
} os_dir_conf;

/* One OvertakeStagePrefix. */
typedef struct {
    const char *prefix;
    size_t len;
    const char *method;             /* NULL: any method */
    int stage;                      /* shared stage index or OS_NONE */
    const char *file;               /* where it was read, for the refusal of a repeat */
    int line;
} os_prefix;

/* A server's prefixes: its own as read, and (from check_config) the list a request of the server
 * is matched against: the main server's and its own, longest first. */
struct op_stage_prefixes {
    apr_array_header_t *own;        /* of os_prefix */
    const os_prefix *match;
    int nmatch;
};

/* ------------------------------------------------------------------------ sections */

void *op_stage_create_dir_conf(apr_pool_t *p, char *dir)
{
    os_dir_conf *d = apr_palloc(p, sizeof *d);
    (void)dir;
    d->stage = OS_UNSET;
    return d;
}

/* Per request whose URL matches a section: the configs are never written after the config read,
 * so the one that decides is returned as it is (no allocation). */
void *op_stage_merge_dir_conf(apr_pool_t *p, void *base, void *add)
{
    (void)p;
    return ((const os_dir_conf *)add)->stage != OS_UNSET ? add : base;
}

/* The index of stage name (added if new), or -1 with *err set. */
static int stage_index(cmd_parms *cmd, const char *name, const char **err)
{
    uint8_t padded[OS_NAME_BYTES];
    int i;
    memset(padded, 0, sizeof padded);
    if (strlen(name) >= OS_NAME_BYTES || (memcpy(padded, name, strlen(name)), !os_name_ok(padded))) {
        *err = apr_psprintf(cmd->pool, "%s: '%s' is not a stage name: 1..%d letters, digits, '_', "
                            "'.', '-' (the name of the sidecar's stages file)",
                            cmd->cmd->name, name, OS_NAME_BYTES - 1);
        return -1;
    }
    for (i = 0; i < os_nnames && strcmp(os_names[i], name); i++) {
    }
    if (i == os_nnames) {
        if (os_nnames == OS_MAX_STAGES) {
            *err = apr_psprintf(cmd->pool, "%s: '%s' would be stage %d; at most %d stages",
                                cmd->cmd->name, name, OS_MAX_STAGES + 1, OS_MAX_STAGES);
            return -1;
        }
        memcpy(os_names[os_nnames], padded, OS_NAME_BYTES);
        os_next[os_nnames++] = -1;
    }
    return i;
}

/* A stage name or none: the index or OS_NONE; *err set (and OS_UNSET returned) if not a name. */
static int stage_or_none(cmd_parms *cmd, const char *name, const char **err)
{
    int i;
    if (!strcasecmp(name, "none")) {
        return OS_NONE;
    }
    return (i = stage_index(cmd, name, err)) < 0 ? OS_UNSET : i;
}

const char *op_stage_set(cmd_parms *cmd, void *dconf, const char *name)
{
    os_dir_conf *d = dconf;
    const char *err = NULL;
    int i = stage_or_none(cmd, name, &err);
    if (err) {
        return err;
    }
    d->stage = i;
    return NULL;
}

/* ------------------------------------------------------------------------ prefixes */

static const char *check_prefix(cmd_parms *cmd, const char *prefix, const char *method)
{
    const char *m;
    if (prefix[0] != '/' || strpbrk(prefix, "?#")) {
        return apr_psprintf(cmd->pool, "OvertakeStagePrefix: '%s' must be a literal URL path that "
                            "starts with '/' and has no query, e.g. /static/ (for a pattern use "
                            "OvertakeStage in a <LocationMatch>)", prefix);
    }
    for (m = method; m && *m; m++) {
        if (!((*m >= 'A' && *m <= 'Z') || (*m >= '0' && *m <= '9') || *m == '_' || *m == '-')) {
            break;
        }
    }
    if (method && (!*method || *m || strlen(method) > 32)) {
        return apr_psprintf(cmd->pool, "OvertakeStagePrefix: '%s' is not an HTTP method: upper case, "
                            "e.g. POST (leave it out for every method)", method);
    }
    return NULL;
}

/* OvertakeStagePrefix PREFIX STAGE [METHOD] */
const char *op_stage_set_prefix(cmd_parms *cmd, void *dconf, const char *prefix, const char *name,
                                const char *method)
{
    op_conf *c = ap_get_module_config(cmd->server->module_config, &overtake_prio_module);
    const char *err = check_prefix(cmd, prefix, method);
    os_prefix *e;
    int i;
    (void)dconf;
    if (err || (i = stage_or_none(cmd, name, &err), err)) {
        return err;
    }
    if (!c->stage_prefixes) {
        c->stage_prefixes = apr_pcalloc(cmd->pool, sizeof *c->stage_prefixes);
        c->stage_prefixes->own = apr_array_make(cmd->pool, 4, sizeof(os_prefix));
    }
    e = apr_array_push(c->stage_prefixes->own);
    e->prefix = apr_pstrdup(cmd->pool, prefix);
    e->len = strlen(prefix);
    e->method = method ? apr_pstrdup(cmd->pool, method) : NULL;
    e->stage = i;
    e->file = cmd->directive ? cmd->directive->filename : "?";
    e->line = cmd->directive ? cmd->directive->line_num : 0;
    return NULL;
}

static int same_key(const os_prefix *a, const os_prefix *b)
{
    return a->len == b->len && !strcmp(a->prefix, b->prefix)
           && (a->method ? b->method && !strcmp(a->method, b->method) : !b->method);
}

/* Longest prefix first; of equal prefixes, the one with a method first. */
static int by_match_order(const void *x, const void *y)
{
    const os_prefix *a = x, *b = y;
    if (a->len != b->len) {
        return a->len > b->len ? -1 : 1;
    }
    return (b->method != NULL) - (a->method != NULL);
}

static const char *stage_label(int stage)
{
    return stage >= 0 ? os_names[stage] : "none";
}

/* A prefix and method given twice in one server's config: refused, naming both lines. */
static int refuse_repeats(server_rec *s, const apr_array_header_t *own)
{
    const os_prefix *e = (const os_prefix *)own->elts;
    int i, j;
    for (i = 0; i < own->nelts; i++) {
        for (j = 0; j < i; j++) {
            if (!same_key(&e[i], &e[j])) {
                continue;
            }
            ap_log_error(APLOG_MARK, APLOG_STARTUP | APLOG_EMERG, 0, s, APLOGNO(90304)
                         "OvertakeStagePrefix %s%s%s (stage %s) at %s:%d repeats the one at %s:%d "
                         "(stage %s); keep one of the two lines: a prefix and method name one "
                         "stage per server (a longer prefix gives a subtree another stage)",
                         e[i].prefix, e[i].method ? " " : "", e[i].method ? e[i].method : "",
                         stage_label(e[i].stage), e[i].file, e[i].line, e[j].file, e[j].line,
                         stage_label(e[j].stage));
            return 0;
        }
    }
    return 1;
}

/* The list server s matches against: main's prefixes (those s does not repeat) and its own. */
static void compile(apr_pool_t *p, struct op_stage_prefixes *mine, const struct op_stage_prefixes *main_p)
{
    apr_array_header_t *all = apr_array_make(p, 8, sizeof(os_prefix));
    int i, j;
    for (i = 0; main_p && i < main_p->own->nelts; i++) {
        const os_prefix *e = &((const os_prefix *)main_p->own->elts)[i];
        for (j = 0; mine != main_p && j < mine->own->nelts
             && !same_key(e, &((const os_prefix *)mine->own->elts)[j]); j++) {
        }
        if (mine == main_p || j == mine->own->nelts) {
            *(os_prefix *)apr_array_push(all) = *e;
        }
    }
    if (mine != main_p) {
        apr_array_cat(all, mine->own);
    }
    qsort(all->elts, (size_t)all->nelts, sizeof(os_prefix), by_match_order);
    mine->match = (const os_prefix *)all->elts;
    mine->nmatch = all->nelts;
}

/* check_config: every server's match list; 0 (logged) if a server repeats a prefix. */
int op_stage_check_config(apr_pool_t *p, server_rec *main_s)
{
    const op_conf *mc = ap_get_module_config(main_s->module_config, &overtake_prio_module);
    server_rec *s;
    for (s = main_s; s; s = s->next) {
        op_conf *c = ap_get_module_config(s->module_config, &overtake_prio_module);
        if (s != main_s && c == mc) {
            continue;  /* shares the main server's config */
        }
        if (c->stage_prefixes && !refuse_repeats(s, c->stage_prefixes->own)) {
            return 0;
        }
        if (!c->stage_prefixes && mc->stage_prefixes) {
            c->stage_prefixes = apr_pcalloc(p, sizeof *c->stage_prefixes);
            c->stage_prefixes->own = apr_array_make(p, 1, sizeof(os_prefix));
        }
        if (c->stage_prefixes) {
            compile(p, c->stage_prefixes, mc->stage_prefixes);
        }
    }
    return 1;
}

/* Does the path start with the prefix, at a segment boundary? */
static int under(const char *uri, const os_prefix *e)
{
    return !strncmp(uri, e->prefix, e->len)
           && (e->prefix[e->len - 1] == '/' || uri[e->len] == '/' || uri[e->len] == '\0');
}

/* The stage of request r: its sections' OvertakeStage, else its server's longest matching
 * prefix; OS_NONE if neither names one. */
OP_HOT int os_stage_of(const request_rec *r)
{
    const os_dir_conf *d = ap_get_module_config(r->per_dir_config, &overtake_prio_module);
    const struct op_stage_prefixes *pp;
    int i;
    if (d && d->stage != OS_UNSET) {
        return d->stage;
    }
    pp = ((const op_conf *)ap_get_module_config(r->server->module_config, &overtake_prio_module))
         ->stage_prefixes;
    if (!pp || !r->uri) {
        return OS_NONE;
    }
    for (i = 0; i < pp->nmatch; i++) {
        const os_prefix *e = &pp->match[i];
        if (under(r->uri, e) && (!e->method || !strcmp(e->method, r->method))) {
            return e->stage;
        }
    }
    return OS_NONE;
}

/* ------------------------------------------------------------------------ server directives */

const char *op_stage_set_next(cmd_parms *cmd, void *dconf, const char *from, const char *to)
{
    const char *err = ap_check_cmd_context(cmd, GLOBAL_ONLY);
    int a, b;
    (void)dconf;
    if (err) {
        return err;
    }
    if ((a = stage_index(cmd, from, &err)) < 0 || (b = stage_index(cmd, to, &err)) < 0) {
        return err;
    }
    if (a == b) {
        return apr_psprintf(cmd->pool, "OvertakeStageNext: '%s' cannot follow itself; name the "
                            "stage its requests' follow-ups belong to", from);
    }
    if (os_next[a] >= 0 && os_next[a] != b) {
        return apr_psprintf(cmd->pool, "OvertakeStageNext: '%s' already has next stage '%s'; a "
                            "stage has at most one", from, os_names[os_next[a]]);
    }
    os_next[a] = b;
    return NULL;
}

/* A server-wide seconds directive: global context only, a value in [lo, hi], else the directive,
 * the value, the range (as written: APR's %g drops a leading zero) and what the value means. */
static const char *set_seconds(cmd_parms *cmd, const char *directive, const char *w, double lo, double hi,
                               const char *range, const char *meaning, double *out)
{
    const char *err = ap_check_cmd_context(cmd, GLOBAL_ONLY);
    double v;
    if (err) {
        return err;
    }
    if (!op_parse_seconds(w, lo, hi, &v)) {
        return apr_psprintf(cmd->pool, "%s: '%s' must be seconds in %s, %s", directive, w, range, meaning);
    }
    *out = v;
    return NULL;
}

const char *op_stage_set_follow_up(cmd_parms *cmd, void *dconf, const char *w)
{
    (void)dconf;
    return set_seconds(cmd, "OvertakeStageFollowUp", w, 0.0001, 60, "[0.0001, 60]",
                       "the longest a reservation waits for the connection's next request", &os_follow_s);
}

const char *op_stage_set_hold(cmd_parms *cmd, void *dconf, const char *w)
{
    (void)dconf;
    return set_seconds(cmd, "OvertakeStageHold", w, 0.001, 3600, "[0.001, 3600]",
                       "the longest a request waits for its stage's turn", &os_hold_s);
}

const char *op_stage_set_lifo_after(cmd_parms *cmd, void *dconf, const char *w)
{
    (void)dconf;
    return set_seconds(cmd, "OvertakeStageLifoAfter", w, 0, 3600, "[0, 3600]",
                       "how long a stage's queue stands before its newest requests start first (0: never)",
                       &os_lifo_s);
}

int op_stage_pre_config(apr_pool_t *pconf, apr_pool_t *plog, apr_pool_t *ptemp)
{
    (void)pconf; (void)plog; (void)ptemp;
    os_nnames = 0;
    os_hold_s = 30.0;
    os_follow_s = 0.005;
    os_abort_on_close = 1;
    os_lifo_s = 0;
    return OK;
}
