/*
 * op_stage_status.c -- module mode's lines on the status page (Prometheus text format): per
 * stage its counts, its follow-up reservations, its counters, and the count table in force in
 * the child that answers.
 */
#include "mod_overtake_prio.h"

#include <string.h>

#include "http_protocol.h"

#include "op_stage.h"

static const char *const os_res_name[OS_RES_N] = {"claimed", "expired", "closed", "other"};
static const char *const os_by_name[OS_BY_N] = {"apache", "fcgi", "proxy", "cgi"};

/* What the page shows of the counts, copied under the lock: nothing is written while it is held. */
typedef struct {
    uint32_t n;
    int32_t waiting[OS_MAX_STAGES], active[OS_MAX_STAGES], rwait[OS_MAX_STAGES], rrun[OS_MAX_STAGES];
    int held[OS_MAX_STAGES];
    uint32_t gen;
    os_table t;
} os_snapshot;

static void snapshot(os_snapshot *v)
{
    uint32_t i;
    memset(v->rwait, 0, sizeof v->rwait);
    memset(v->rrun, 0, sizeof v->rrun);
    os_lock();
    if (os_res_expire(op_mono_ns())) {
        os_epoch();  /* a freed slot may start a waiting request */
    }
    v->n = os_shm->nstages;
    for (i = 0; i < os_shm->res_hi; i++) {
        const os_res *r = &os_shm->res[i];
        if (r->stage >= 0) {
            (os_started(&os_shm->st[r->stage].q, os_shm->st[r->stage].q.head, r->ticket) ? v->rrun
                                                                                     : v->rwait)[r->stage]++;
        }
    }
    for (i = 0; i < v->n; i++) {
        v->waiting[i] = os_shm->st[i].q.waiting - v->rwait[i];  /* requests only: reservations apart */
        v->active[i] = os_shm->st[i].q.active - v->rrun[i];
        v->held[i] = os_tab_now.generation && os_tab_now.in_table[i] >= 0;
    }
    v->gen = os_tab_now.generation;
    v->t = os_tab_now.t;
    os_unlock();
}

static void metric(request_rec *r, const char *name, const char *type, const char *help)
{
    ap_rprintf(r, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* One gauge line per stage from an array of the snapshot. */
static void per_stage(request_rec *r, const char *name, const char *help, const int32_t *x, uint32_t n)
{
    uint32_t i;
    metric(r, name, "gauge", help);
    for (i = 0; i < n; i++) {
        ap_rprintf(r, "%s{stage=\"%s\"} %d\n", name, os_shm->names[i], x[i]);
    }
}

#define STAGE_COUNTER(name, field, help) do {                                             \
        metric(r, name, "counter", help);                                                 \
        for (i = 0; i < n; i++) {                                                         \
            ap_rprintf(r, name "{stage=\"%s\"} %" APR_UINT64_T_FMT "\n", os_shm->names[i],   \
                       LOAD(os_shm->st[i].field));                                        \
        }                                                                                 \
    } while (0)

static void counts_status(request_rec *r, const os_snapshot *v)
{
    uint32_t i, n = v->n;
    /* the stage links as Apache read them, for the controller to compare with its stages file */
    metric(r, "overtake_stage_next", "gauge",
           "1 per OvertakeStage, labelled with the stage its OvertakeStageNext names (next=\"\": none).");
    for (i = 0; i < n; i++) {
        int32_t nx = os_shm->next[i];
        ap_rprintf(r, "overtake_stage_next{stage=\"%s\",next=\"%s\"} 1\n", os_shm->names[i],
                   nx >= 0 && (uint32_t)nx < n ? os_shm->names[nx] : "");
    }
    per_stage(r, "overtake_stage_waiting", "Requests of the stage waiting for their turn.", v->waiting, n);
    per_stage(r, "overtake_stage_active", "Requests of the stage running (started, not ended).", v->active, n);
    metric(r, "overtake_stage_reserved", "gauge", "Follow-up reservations of the stage outstanding "
           "(state=waiting: in its queue; started: holding a slot idle for the connection's next "
           "request). The count table sees waiting + active + reserved.");
    for (i = 0; i < n; i++) {
        ap_rprintf(r, "overtake_stage_reserved{stage=\"%s\",state=\"waiting\"} %d\n"
                   "overtake_stage_reserved{stage=\"%s\",state=\"started\"} %d\n",
                   os_shm->names[i], v->rwait[i], os_shm->names[i], v->rrun[i]);
    }
}

static void reservations_status(request_rec *r, uint32_t n)
{
    uint32_t i;
    int o;
    STAGE_COUNTER("overtake_stage_reservations_total", reservations,
                  "Follow-up reservations made in the stage (OvertakeStageNext).");
    STAGE_COUNTER("overtake_stage_reservations_refused_total", res_full,
                  "Follow-ups of the stage not reserved: every reservation slot or queue ticket was in use.");
    metric(r, "overtake_stage_reservations_ended_total", "counter",
           "Follow-up reservations ended, by outcome (claimed: the connection's next request took "
           "it; expired: none came within OvertakeStageFollowUp; closed: the connection closed; "
           "other: the next request was of another stage).");
    for (i = 0; i < n; i++) {
        for (o = 0; o < OS_RES_N; o++) {
            ap_rprintf(r, "overtake_stage_reservations_ended_total{stage=\"%s\",outcome=\"%s\"} %"
                       APR_UINT64_T_FMT "\n", os_shm->names[i], os_res_name[o],
                       LOAD(os_shm->st[i].res_ended[o]));
        }
    }
}

static void requests_status(request_rec *r, uint32_t n)
{
    uint32_t i;
    int b;
    STAGE_COUNTER("overtake_stage_requests_total", requests, "Requests of the stage (OvertakeStage).");
    STAGE_COUNTER("overtake_stage_held_total", held, "Requests of the stage that waited for their turn.");
    STAGE_COUNTER("overtake_stage_hold_timeouts_total", hold_timeouts,
                  "Requests that waited OvertakeStageHold and ran anyway.");
    STAGE_COUNTER("overtake_stage_overflows_total", overflows,
                  "Requests that found their stage's queue full and ran at once.");
    STAGE_COUNTER("overtake_stage_given_back_total", given_back,
                  "Requests counted by a child that died without ending them, given back by the parent.");
    STAGE_COUNTER("overtake_stage_newest_first_total", newest_first,
                  "Starts given to the stage's newest waiting request, its queue having stood "
                  "longer than OvertakeStageLifoAfter.");
    STAGE_COUNTER("overtake_stage_dropped_total", dropped,
                  "Held requests dropped, not run: their client went away while they waited "
                  "(reset, or half-closed unless OvertakeStageAbortOnClose Off).");
    metric(r, "overtake_stage_hold_seconds_total", "counter", "Total wait of the stage's held requests.");
    for (i = 0; i < n; i++) {
        ap_rprintf(r, "overtake_stage_hold_seconds_total{stage=\"%s\"} %.9f\n", os_shm->names[i],
                   (double)LOAD(os_shm->st[i].hold_ns) / 1e9);
    }
    metric(r, "overtake_stage_served_total", "counter",
           "Requests of the stage ended, by where their work ran (by=apache: a handler in Apache's "
           "process; fcgi: a FastCGI server such as PHP-FPM; proxy: another HTTP server; cgi: a CGI process).");
    for (i = 0; i < n; i++) {
        for (b = 0; b < OS_BY_N; b++) {
            ap_rprintf(r, "overtake_stage_served_total{stage=\"%s\",by=\"%s\"} %" APR_UINT64_T_FMT "\n",
                       os_shm->names[i], os_by_name[b], LOAD(os_shm->st[i].served[b]));
        }
    }
}

static void decisions_status(request_rec *r)
{
    metric(r, "overtake_stage_decisions_total", "counter",
           "Decisions taken under the lock (arrivals, completions and table changes); an arrival "
           "or end that finds nothing waiting takes none (op_stage_fast.c).");
    ap_rprintf(r, "overtake_stage_decisions_total %" APR_UINT64_T_FMT "\n", LOAD(os_shm->epochs));
    metric(r, "overtake_stage_wakeups_total", "counter",
           "Futex wake-ups issued to start held requests (a system call each).");
    ap_rprintf(r, "overtake_stage_wakeups_total %" APR_UINT64_T_FMT "\n", LOAD(os_shm->wakes));
    metric(r, "overtake_stage_guard_starts_total", "counter",
           "Requests started because nothing ran while requests waited and the table started none.");
    ap_rprintf(r, "overtake_stage_guard_starts_total %" APR_UINT64_T_FMT "\n",
               LOAD(os_shm->guard_starts));
    metric(r, "overtake_stage_child_blocks", "gauge",
           "Children with a share of the counts (op_stage_child.c): Apache's children, and any "
           "that died and were not reaped.");
    ap_rprintf(r, "overtake_stage_child_blocks %d\n", op_stage_child_blocks());
}

static void table_status(request_rec *r, const os_snapshot *v)
{
    uint32_t i;
    metric(r, "overtake_stage_table_generation", "gauge",
           "Generation of the control file whose count table this child enforces (0: none: "
           "requests run at once).");
    ap_rprintf(r, "overtake_stage_table_generation %u\n", v->gen);
    metric(r, "overtake_stage_table_in_force", "gauge",
           "1 if the stage is held by the count table in this child, 0 if its requests run at once.");
    for (i = 0; i < v->n; i++) {
        ap_rprintf(r, "overtake_stage_table_in_force{stage=\"%s\"} %d\n", os_shm->names[i], v->held[i]);
    }
    metric(r, "overtake_stage_table_caps", "gauge",
           "The count table's caps per stage (kind=waiting|active): beyond them its documented default applies.");
    for (i = 0; v->gen && i < v->t.n; i++) {
        ap_rprintf(r, "overtake_stage_table_caps{stage=\"%s\",kind=\"waiting\"} %u\n"
                   "overtake_stage_table_caps{stage=\"%s\",kind=\"active\"} %u\n",
                   v->t.name[i], v->t.wcap[i], v->t.name[i], v->t.kcap[i]);
    }
    metric(r, "overtake_stage_hold_limit_seconds", "gauge", "OvertakeStageHold.");
    ap_rprintf(r, "overtake_stage_hold_limit_seconds %g\n", os_hold_s);
    metric(r, "overtake_stage_abort_on_close", "gauge",
           "OvertakeStageAbortOnClose: 1 if a held request whose client half-closed is dropped.");
    ap_rprintf(r, "overtake_stage_abort_on_close %d\n", os_abort_on_close);
    metric(r, "overtake_stage_lifo_after_seconds", "gauge",
           "OvertakeStageLifoAfter: how long a queue stands before its newest requests start first (0: never).");
    ap_rprintf(r, "overtake_stage_lifo_after_seconds %g\n", (double)os_shm->lifo_ns / 1e9);
    metric(r, "overtake_stage_follow_up_limit_seconds", "gauge",
           "OvertakeStageFollowUp: how long a follow-up reservation waits for its request.");
    ap_rprintf(r, "overtake_stage_follow_up_limit_seconds %g\n", (double)os_shm->follow_ns / 1e9);
}

void op_stage_status(request_rec *r)
{
    os_snapshot v;
    if (!os_shm) {
        return;
    }
    snapshot(&v);
    counts_status(r, &v);
    reservations_status(r, v.n);
    requests_status(r, v.n);
    decisions_status(r);
    table_status(r, &v);
}
