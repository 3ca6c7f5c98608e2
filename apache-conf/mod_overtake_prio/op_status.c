/*
 * op_status.c -- the handler "overtake-prio-status": the module's settings, the counters of
 * every child and the gauges of the answering child, in the Prometheus text format.
 */
#include "mod_overtake_prio.h"
#include "op_guard.h"

#include <string.h>
#include <unistd.h>

#include "http_protocol.h"

static void metric_head(request_rec *r, const char *name, const char *type, const char *help)
{
    ap_rprintf(r, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* The page (not inlined: the handler below runs for every request and stays a compare). */
static __attribute__((noinline)) int status_page(request_rec *r)
{
    const op_conf *c;
    apr_int64_t inflight[OP_MAX_LEVELS + 1];
    int k, n;
    if (r->method_number != M_GET) {
        r->allowed = AP_METHOD_BIT << M_GET;
        return HTTP_METHOD_NOT_ALLOWED;
    }
    c = ap_get_module_config(r->server->module_config, &overtake_prio_module);
    ap_set_content_type(r, "text/plain; version=0.0.4; charset=utf-8");
    apr_table_setn(r->headers_out, "Cache-Control", "no-store");
    if (r->header_only) {
        return OK;
    }
    n = conf_nlevels(c);
    op_control_refresh(c);

    metric_head(r, "overtake_cpu_prio_enabled", "gauge",
                "1 if this child demotes and restores worker threads (self-test passed).");
    ap_rprintf(r, "overtake_cpu_prio_enabled %d\n", __atomic_load_n(&op_hot.child_ok, __ATOMIC_ACQUIRE));
    metric_head(r, "overtake_cpu_prio_levels", "gauge", "Demoted levels (level 0 = original).");
    ap_rprintf(r, "overtake_cpu_prio_levels %d\n", n);
    metric_head(r, "overtake_cpu_prio_level_threshold_seconds", "gauge",
                "Thread CPU at which a request enters the level.");
    for (k = 1; k <= n; k++) {
        ap_rprintf(r, "overtake_cpu_prio_level_threshold_seconds{level=\"%d\"} %.9g\n", k,
                   op_control_threshold(c, k - 1));
    }
    metric_head(r, "overtake_cpu_prio_level_nice_increment", "gauge",
                "Nice increment of the level over the thread's own (not for SCHED_IDLE levels).");
    for (k = 0; k <= n; k++) {
        int v = k ? conf_nice(c, k - 1) : 0;
        if (v != OP_NICE_IDLE) {
            ap_rprintf(r, "overtake_cpu_prio_level_nice_increment{level=\"%d\"} %d\n", k, v);
        }
    }
    metric_head(r, "overtake_cpu_prio_level_sched_idle", "gauge",
                "1 if the level runs its threads under SCHED_IDLE.");
    for (k = 0; k <= n; k++) {
        ap_rprintf(r, "overtake_cpu_prio_level_sched_idle{level=\"%d\"} %d\n", k,
                   k > 0 && conf_nice(c, k - 1) == OP_NICE_IDLE);
    }
    metric_head(r, "overtake_cpu_prio_monitor_interval_seconds", "gauge",
                "Period of the monitor thread.");
    ap_rprintf(r, "overtake_cpu_prio_monitor_interval_seconds %.9g\n", conf_interval(c));
    metric_head(r, "overtake_cpu_prio_cpu_resolution_seconds", "gauge",
                "A worker re-reads its thread CPU clock at most this often; attained CPU is "
                "overcounted by less.");
    ap_rprintf(r, "overtake_cpu_prio_cpu_resolution_seconds %.9g\n", conf_resolution(c));
    metric_head(r, "overtake_cpu_prio_age_enabled", "gauge",
                "1 if requests are demoted by attained thread CPU.");
    ap_rprintf(r, "overtake_cpu_prio_age_enabled %d\n", conf_age(c));
    metric_head(r, "overtake_cpu_prio_rlimit_nice", "gauge",
                "RLIMIT_NICE of this child (20 lets a thread return to nice 0).");
    ap_rprintf(r, "overtake_cpu_prio_rlimit_nice %d\n", op_rlimit_cur);
    metric_head(r, "overtake_cpu_prio_cap_sys_nice", "gauge",
                "1 if this child kept CAP_SYS_NICE to restore threads (RLIMIT_NICE too low).");
    ap_rprintf(r, "overtake_cpu_prio_cap_sys_nice %d\n", op_has_cap_sys_nice);
    metric_head(r, "overtake_cpu_prio_child_pid", "gauge",
                "PID of the child that answered (in-flight gauges are per child).");
    ap_rprintf(r, "overtake_cpu_prio_child_pid %ld\n", (long)getpid());

    metric_head(r, "overtake_cpu_prio_in_flight", "gauge",
                "Requests in flight in this child, by current level.");
    op_inflight_count(inflight);
    for (k = 0; k <= n; k++) {
        ap_rprintf(r, "overtake_cpu_prio_in_flight{level=\"%d\"} %" APR_INT64_T_FMT "\n", k,
                   inflight[k]);
    }
    op_guard_status(r, c);
    if (!op_shm) {
        return OK;
    }
    metric_head(r, "overtake_cpu_prio_requests_total", "counter",
                "Requests ended, by the deepest level they reached.");
    for (k = 0; k <= n; k++) {
        ap_rprintf(r, "overtake_cpu_prio_requests_total{level=\"%d\"} %" APR_UINT64_T_FMT "\n",
                   k, LOAD(op_shm->requests[k]));
    }
    metric_head(r, "overtake_cpu_prio_demotions_total", "counter",
                "Requests that entered the level, by cause (attained CPU or class header).");
    for (k = 1; k <= n; k++) {
        ap_rprintf(r, "overtake_cpu_prio_demotions_total{level=\"%d\",cause=\"age\"} %"
                   APR_UINT64_T_FMT "\n", k, LOAD(op_shm->demoted_age[k]));
        ap_rprintf(r, "overtake_cpu_prio_demotions_total{level=\"%d\",cause=\"class\"} %"
                   APR_UINT64_T_FMT "\n", k, LOAD(op_shm->demoted_class[k]));
    }
/* a counter of the shared block: overtake_<prefix><name>_total */
#define COUNTER(prefix, name, field, help)                                              \
    metric_head(r, "overtake_" prefix name "_total", "counter", help);                  \
    ap_rprintf(r, "overtake_" prefix name "_total %" APR_UINT64_T_FMT "\n", LOAD(op_shm->field))
#define PRIO_COUNTER(name, field, help) COUNTER("cpu_prio_", name, field, help)
#define GATE_COUNTER(name, field, help) COUNTER("gate_", name, field, help)
    PRIO_COUNTER("restores", restores, "Demoted threads given their original priority back.");
    PRIO_COUNTER("restore_errors", restore_errors, "Restores the kernel refused.");
    PRIO_COUNTER("demote_errors", demote_errors, "Demotions the kernel refused.");
    PRIO_COUNTER("untracked", untracked, "Requests on threads beyond the slot table.");
    PRIO_COUNTER("class_invalid", class_invalid, "Class headers that were not a level.");
    PRIO_COUNTER("handoffs", handoffs,
            "Threads that began a request before the previous one's pool was cleaned up.");
    PRIO_COUNTER("monitor_ticks", monitor_ticks, "Monitor passes, all children.");
    PRIO_COUNTER("clock_reads", clock_reads, "Thread CPU clock reads at request start, all children.");
    {
        op_gate_state g;
        op_gate_snapshot(c, &g);
        metric_head(r, "overtake_gate_configured", "gauge", "1 if OvertakeGate names a gate file.");
        ap_rprintf(r, "overtake_gate_configured %d\n", c->gate_file != NULL);
        metric_head(r, "overtake_gate_key_loaded", "gauge",
                    "1 if Apache read the gate's key file at start (else gated requests pass).");
        ap_rprintf(r, "overtake_gate_key_loaded %d\n", g.key_loaded);
        metric_head(r, "overtake_gate_mapped", "gauge",
                    "1 if this child has mapped the sidecar's gate file (written with its key).");
        ap_rprintf(r, "overtake_gate_mapped %d\n", g.mapped);
        metric_head(r, "overtake_gate_token", "gauge",
                    "Pairing token in the mapped gate file (the sidecar checks it is its own).");
        ap_rprintf(r, "overtake_gate_token %u\n", g.token);
        metric_head(r, "overtake_gate_slots", "gauge", "Slots in the mapped gate file.");
        ap_rprintf(r, "overtake_gate_slots %u\n", g.nslots);
    }
    GATE_COUNTER("held", gate_held, "Gated requests let through by the sidecar's admission.");
    GATE_COUNTER("cancels", gate_cancels, "Gated requests the sidecar withdrew (answered 503).");
    GATE_COUNTER("stale", gate_stale, "Gated requests whose slot had moved on (answered 503).");
    GATE_COUNTER("timeouts", gate_timeouts, "Gated requests let through after OvertakeGateTimeout.");
    GATE_COUNTER("aborts", gate_aborts, "Gated requests whose connection the sidecar closed.");
    GATE_COUNTER("invalid", gate_invalid, "Gate headers that were not a slot of the file (400).");
    GATE_COUNTER("forged", gate_forged, "Gate headers whose MAC is not the sidecar's key's (403).");
    GATE_COUNTER("unmapped", gate_unmapped, "Gated requests let through for want of a gate file.");
    GATE_COUNTER("faults", gate_faults,
            "Loads that found the gate file shrunk under its mapping (its requests let through).");
    GATE_COUNTER("idle_starts", gate_idle_starts,
            "Gated requests started at the lowest level (SCHED_IDLE) before their admission.");
    GATE_COUNTER("promotions", gate_promotions, "Idle starts given their priority back on admission.");
#undef GATE_COUNTER
#undef PRIO_COUNTER
#undef COUNTER
    metric_head(r, "overtake_gate_wait_seconds_total", "counter",
                "Time gated requests waited for their admission, all children.");
    ap_rprintf(r, "overtake_gate_wait_seconds_total %.9g\n", LOAD(op_shm->gate_wait_ns) * 1e-9);
    metric_head(r, "overtake_cpu_prio_monitor_late_max_seconds", "gauge",
                "Worst delay of a monitor pass in this child.");
    ap_rprintf(r, "overtake_cpu_prio_monitor_late_max_seconds %.9g\n", op_late_max_ns * 1e-9);
    metric_head(r, "overtake_cpu_prio_monitor_late_seconds", "histogram",
                "Delay of the monitor's passes past their due time, this child.");
    {
        apr_uint64_t cum = 0;
        unsigned b;
        for (b = 0; b < OP_LATE_BUCKETS; b++) {
            cum += LOAD(op_late_count[b]);
            ap_rprintf(r, "overtake_cpu_prio_monitor_late_seconds_bucket{le=\"%g\"} %"
                       APR_UINT64_T_FMT "\n", op_late_le[b], cum);
        }
        cum += LOAD(op_late_count[OP_LATE_BUCKETS]);
        ap_rprintf(r, "overtake_cpu_prio_monitor_late_seconds_bucket{le=\"+Inf\"} %"
                   APR_UINT64_T_FMT "\n", cum);
        ap_rprintf(r, "overtake_cpu_prio_monitor_late_seconds_sum %.9g\n", op_late_sum_ns * 1e-9);
        ap_rprintf(r, "overtake_cpu_prio_monitor_late_seconds_count %" APR_UINT64_T_FMT "\n", cum);
    }
    op_control_status(r, c);
    op_stage_status(r);
    return OK;
}

OP_HOT int op_status_handler(request_rec *r)
{
    /* every request's handler phase comes here: its first byte settles most */
    if (!r->handler || r->handler[0] != OP_HANDLER[0] || strcmp(r->handler, OP_HANDLER)) {
        return DECLINED;
    }
    return status_page(r);
}
