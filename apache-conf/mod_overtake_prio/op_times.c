/*
 * op_times.c -- where a request's wall time went: CPU, run-queue wait and blocked time.
 *
 * With OvertakeRequestTimes On, the handling thread reads its CPU clock
 * (CLOCK_THREAD_CPUTIME_ID), its run-queue wait (the second field of /proc/thread-self/schedstat)
 * and the monotonic clock when the request starts (post_read_request, after the admission gate:
 * a wait there is the sidecar's queue, not the request's) and again when its response's end
 * (EOS) leaves the handler, and sets request notes for the access log (LogFormat %{NAME}n):
 *
 *   overtake_wall_us     wall time between the two readings
 *   overtake_cpu_us      the thread's CPU time in it
 *   overtake_wait_us     time runnable but waiting for a CPU
 *   overtake_blocked_us  the rest: off the CPU and not runnable (a lock, a sleep, I/O)
 *   overtake_start_us    the first reading, microseconds after the request's start (%{begin}t)
 *
 * Under processor sharing wall = cpu + wait; a request waiting for a lock a request of its own
 * stage holds is blocked, and only while such a request runs beside it: the sidecar's
 * serialisation detector (controller/online/serialisation.py) reads that from the log.
 *
 * The thread's schedstat stays open (one per thread, close-on-exec) and is re-read with pread:
 * two reads of it and of each clock per request. Its CPU field is updated only at ticks and
 * switches, so the exact thread clock gives the CPU time. Under prefork the thread is the process;
 * under worker/event each worker thread has its own file. A request whose end runs on another
 * thread than its start gets no notes. The pure parts are in op_times_pure.c.
 */
#include "mod_overtake_prio.h"
#include "op_times.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include "apr_strings.h"
#include "http_protocol.h"
#include "http_request.h"

#define OT_KEY "overtake-times"         /* the request pool's user data: its start readings */
#define OT_NO_FILE (-2)                 /* this thread's schedstat cannot be read */

typedef struct {
    pthread_t thread;
    int64_t mono0, cpu0, wait0;         /* wait0 < 0: no schedstat */
    apr_time_t start;                   /* wall clock of the first reading */
    int done;
} ot_req;

int op_times_on;
static int times_warned;                /* per child: the missing schedstat was logged */
static ap_filter_rec_t *times_filter;
/* initial-exec: a plain load from the thread pointer (as op_prio.c's slot) */
static __thread int stat_fd __attribute__((tls_model("initial-exec"))) = -1;

static int times_pre_config(apr_pool_t *pconf, apr_pool_t *plog, apr_pool_t *ptemp)
{
    (void)pconf; (void)plog; (void)ptemp;
    op_times_on = 0;  /* a graceful restart re-reads the config: Off unless it says On again */
    return OK;
}

static int64_t now_ns(clockid_t clk)
{
    struct timespec ts;
    clock_gettime(clk, &ts);
    return op_ts_ns(&ts);
}

/* This thread's run-queue wait so far, or -1 (logged once per child) if schedstat is unreadable. */
static int64_t read_wait(request_rec *r)
{
    char buf[96];
    ssize_t n;
    op_schedstat st;
    if (stat_fd == OT_NO_FILE) {
        return -1;
    }
    if (stat_fd < 0) {
        stat_fd = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    }
    n = stat_fd >= 0 ? pread(stat_fd, buf, sizeof buf, 0) : -1;
    if (n > 0 && op_schedstat_parse(buf, (size_t)n, &st)) {
        return st.wait_ns;
    }
    if (!times_warned) {
        times_warned = 1;
        ap_log_rerror(APLOG_MARK, APLOG_WARNING, n < 0 ? errno : 0, r, APLOGNO(90400)
                      "mod_overtake_prio: cannot read /proc/thread-self/schedstat (a kernel without "
                      "CONFIG_SCHED_INFO, or /proc not mounted): OvertakeRequestTimes notes only "
                      "overtake_cpu_us and overtake_wall_us, not the wait and blocked times");
    }
    if (stat_fd >= 0) {
        close(stat_fd);
    }
    stat_fd = OT_NO_FILE;
    return -1;
}

/* not inlined: the caller, on every request, stays a test without this one's frame */
static __attribute__((noinline)) void times_begin(request_rec *r)
{
    ot_req *t = apr_palloc(r->pool, sizeof *t);
    t->thread = pthread_self();
    t->done = 0;
    /* the wall clock last at the start and first at the end: the wall time holds the others */
    t->wait0 = read_wait(r);
    t->cpu0 = now_ns(CLOCK_THREAD_CPUTIME_ID);
    t->start = apr_time_now();
    t->mono0 = now_ns(CLOCK_MONOTONIC);
    apr_pool_userdata_setn(t, OT_KEY, NULL, r->pool);
}

/* The request start (mod_overtake_prio.c's, after the gate: a wait there is the sidecar's queue,
 * not the request's). Off, it costs a test: the readings are apart. */
OP_HOT void op_times_start(request_rec *r)
{
    if (op_times_on && !r->main && !r->prev) {
        times_begin(r);  /* subrequests and internal redirects belong to the first request */
    }
}

/* An internal redirect shares its first request's pool, so it finds the same readings. */
static __attribute__((noinline)) void times_filter_add(request_rec *r)
{
    void *t = NULL;
    apr_pool_userdata_get(&t, OT_KEY, r->pool);
    if (t) {
        ap_add_output_filter_handle(times_filter, t, r, r->connection);
    }
}

OP_HOT void op_times_insert_filter(request_rec *r)
{
    if (op_times_on && !r->main) {
        times_filter_add(r);
    }
}

static void set_us(request_rec *r, const char *name, int64_t ns)
{
    apr_table_setn(r->notes, name, apr_psprintf(r->pool, "%" APR_INT64_T_FMT, ns / 1000));
}

static void times_end(request_rec *r, ot_req *t)
{
    int64_t mono1 = now_ns(CLOCK_MONOTONIC), cpu1, wait1;
    op_times_split_t sp;
    if (t->done) {
        return;
    }
    t->done = 1;
    if (!pthread_equal(t->thread, pthread_self())) {
        return;  /* another thread's clocks: nothing to subtract */
    }
    cpu1 = now_ns(CLOCK_THREAD_CPUTIME_ID);
    wait1 = t->wait0 >= 0 ? read_wait(r) : -1;
    set_us(r, "overtake_start_us", (int64_t)(t->start - r->request_time) * 1000);
    if (wait1 < 0) {
        set_us(r, "overtake_wall_us", mono1 - t->mono0);
        set_us(r, "overtake_cpu_us", cpu1 - t->cpu0);
        return;
    }
    if (!op_times_split(mono1 - t->mono0, cpu1 - t->cpu0, wait1 - t->wait0, &sp)) {
        return;
    }
    set_us(r, "overtake_wall_us", sp.wall_ns);
    set_us(r, "overtake_cpu_us", sp.cpu_ns);
    set_us(r, "overtake_wait_us", sp.wait_ns);
    set_us(r, "overtake_blocked_us", sp.blocked_ns);
}

/* EOS = the handler and the content filters are done (as op_prio.c's end filter): writing the
 * response out and logging are not the request's work. */
static apr_status_t times_filter_fn(ap_filter_t *f, apr_bucket_brigade *bb)
{
    if (!APR_BRIGADE_EMPTY(bb) && APR_BUCKET_IS_EOS(APR_BRIGADE_LAST(bb))) {
        times_end(f->r, f->ctx);
        ap_remove_output_filter(f);
    }
    return ap_pass_brigade(f->next, bb);
}

void op_times_register_hooks(apr_pool_t *p)
{
    (void)p;
    ap_hook_pre_config(times_pre_config, NULL, NULL, APR_HOOK_MIDDLE);
    /* after the content filters, next to op_prio's end filter */
    times_filter = ap_register_output_filter("OVERTAKE_TIMES_END", times_filter_fn, NULL,
                                             AP_FTYPE_CONTENT_SET + 5);
}
