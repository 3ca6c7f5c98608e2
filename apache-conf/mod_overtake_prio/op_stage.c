/*
 * op_stage.c -- module mode: a staged request's arrival, hold and end inside Apache (no proxy in
 * front).
 *
 * Which request is of which stage is op_stage_conf.c's (OvertakeStage in a section, or
 * OvertakeStagePrefix at server level); the counts, their lock and the count table's decisions
 * are op_stage_decide.c's; follow-up reservations op_stage_follow.c's (op_stage.h has the map).
 *
 * A request of a stage arrives in the fixups hook (after access control: a refused request never
 * waits) and takes a ticket of its stage's queue; the arrival is a decision epoch. A request that
 * may not start waits on its stage's futex word (the head of its queue) in the shared mapping,
 * as a gated request waits on the gate file's. When a running request ends (its pool's cleanup,
 * after the response and the log), the completing worker takes the next decision. A request held
 * past `OvertakeStageHold` seconds runs anyway and is counted (no request is lost).
 *
 * Where the work of a stage runs is counted too: at the end of each request (its pool's cleanup,
 * right after the log: no log hook of its own, which a tiny request would pay for), by the handler
 * that served it (Apache itself, FastCGI as PHP-FPM, another proxy, a CGI process), so the controller
 * can say which CPU lever reaches the stage (the module's age priority only reaches Apache's own
 * threads; behind FastCGI the Apache worker only waits, though it still counts as running: the
 * table is admission against the backend's pool).
 */
#include "mod_overtake_prio.h"

#include <limits.h>
#include <linux/futex.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "http_connection.h"
#include "http_core.h"
#include "http_protocol.h"
#include "http_request.h"

#include "op_stage.h"

/* ------------------------------------------------------------------------ where it ran */

/* Where the final request's work ran, from its handler (and for a proxy, its target's scheme). */
static int served_by(const request_rec *r)
{
    const char *h = r->handler;
    if (!h || (h[0] != 'p' && h[0] != 'P' && h[0] != 'c' && h[0] != 'a')) {
        return OS_BY_APACHE;  /* none of the handlers below: a static file's compares no string */
    }
    if (!strcmp(h, "proxy-server") || !strncasecmp(h, "proxy:", 6)) {
        /* ProxyPass: handler proxy-server, filename proxy:fcgi://...; SetHandler "proxy:fcgi://..."
         * or "proxy:unix:/sock|fcgi://..." */
        return (strstr(h, "fcgi://") || (r->filename && strstr(r->filename, "fcgi://"))) ? OS_BY_FCGI
               : OS_BY_PROXY;
    }
    if (!strcmp(h, "cgi-script") || !strcmp(h, "application/x-httpd-cgi")) {
        return OS_BY_CGI;
    }
    return OS_BY_APACHE;
}

/* ------------------------------------------------------------------------ the end */

OP_HOT void op_stage_request_end(op_request_state *q)
{
    conn_rec *c = q->r->connection;
    const request_rec *last = q->r;
    int nx = os_shm->next[q->stage], i, full = 0;
    /* a follow-up can come only on an HTTP/1 connection kept alive (an HTTP/2 stream's
     * connection ends with its stream) */
    os_conn *oc = nx >= 0 && q->r->proto_num < HTTP_VERSION(2, 0) && c->keepalive == AP_CONN_KEEPALIVE
                  && !c->aborted ? os_conn_state(c, 1) : NULL;
    while (last->next) {
        last = last->next;  /* an internal redirect: the request that ran the handler */
    }
    /* counted here, not in a log hook: the pool's cleanup comes right after the log; a dropped
     * request's work ran nowhere */
    if (!q->dropped) {
        ADD(os_shm->st[q->stage].served[served_by(last)], 1);
    }
    os_mine(q->stage, -1);  /* before the count drops: a child killed in between leaves it counted */
    if (!oc && os_fast_complete(q->stage)) {
        return;  /* nothing waits: no decision, no table to look at */
    }
    op_control_look();  /* decide by the newest table, not the one of this request's start */
    os_lock();
    os_complete(&os_shm->st[q->stage].q);
    if (oc) {
        if ((i = os_res_take(oc)) >= 0) {
            os_res_end((uint32_t)i, OS_RES_OTHER);  /* a pipelined request's, never claimed */
        }
        full = !os_res_make(oc, nx, op_mono_ns()) && LOAD(os_shm->st[nx].res_full) == 1;
    }
    os_epoch();  /* the completing worker decides what starts next */
    os_unlock();
    if (full) {  /* once per stage: the counter tells the rest */
        ap_log_cerror(APLOG_MARK, APLOG_WARNING, 0, c, APLOGNO(90303) "mod_overtake_prio: no "
                      "follow-up reservation of stage %s could be made (all %d slots or its "
                      "queue's tickets in use); its follow-ups arrive as newcomers meanwhile",
                      os_shm->names[nx], OS_MAX_RES);
    }
}

/* ------------------------------------------------------------------------ the hold */

/* Reservations may expire with no decision to see it: a held request gives them up (lock not
 * held); 1 if it looked (the caller looks at its ticket again). Else *wake is brought forward to
 * the next look. */
static int hold_expire(int64_t now, int64_t *wake)
{
    if (LOAD(os_shm->nres) && now >= LOAD(os_shm->res_due)) {
        os_lock();
        if (os_res_expire(now)) {
            os_epoch();
        }
        os_unlock();
        return 1;
    }
    if (now + os_shm->follow_ns < *wake) {
        *wake = now + os_shm->follow_ns;
    }
    return 0;
}

/* A held request looks at its client this often (a system call; the admission gate looks as
 * often): no wait lasts longer. */
#define OS_CLIENT_LOOK_NS INT64_C(100000000)

/* How a hold ended. */
enum { OS_HOLD_TIMEOUT, OS_HOLD_GRANTED, OS_HOLD_GONE };

/* Has the client of a held request gone away? No answer can reach a client that reset the
 * connection (TCP state CLOSE): a client that gives up with an answer unread, or aborts, sends a
 * reset. A half-close (CLOSE_WAIT: the client sent its FIN) is almost always a client that closed
 * its socket after a timeout or a stop (nothing was unread): it counts as gone too, as in the
 * sidecar's queue, nginx and Envoy, unless OvertakeStageAbortOnClose Off serves clients that
 * half-close and still read (HAProxy's default). An HTTP/2 stream the client reset, or whose
 * connection ended, mod_http2 marks aborted. */
static int client_gone(conn_rec *c)
{
    apr_socket_t *sock;
    apr_os_sock_t fd;
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    if (c->aborted) {
        return 1;
    }
    if (c->master || !(sock = ap_get_conn_socket(c)) || apr_os_sock_get(&fd, sock) != APR_SUCCESS
        || getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) {
        return 0;  /* a stream's socket is its connection's; not TCP: nothing to tell */
    }
    return ti.tcpi_state == TCP_CLOSE || (os_abort_on_close && ti.tcpi_state == TCP_CLOSE_WAIT);
}

/* Wait for ticket t of stage s until deadline (the caller counts it among the stage's sleepers).
 * Granted, or the hold bound passed or the client went away: then it leaves the queue counted
 * running (os_give_up), unless granted meanwhile, and its end completes it either way. */
static int hold_counted(os_stage *s, uint32_t t, int64_t deadline, conn_rec *c)
{
    uint32_t repairs = __atomic_load_n(&os_shm->repairs, __ATOMIC_SEQ_CST);
    int64_t look_client = op_mono_ns() + OS_CLIENT_LOOK_NS;
    for (;;) {
        /* the wake word before the look: a grant after it changes the word, and the wait returns */
        uint32_t w = __atomic_load_n(&s->q.wake, __ATOMIC_SEQ_CST), now_repairs;
        struct timespec ts;
        int gone = 0;
        int64_t now = op_mono_ns(), wake = deadline;
        if (os_started(&s->q, __atomic_load_n(&s->q.head, __ATOMIC_SEQ_CST), t)) {
            return OS_HOLD_GRANTED;
        }
        if (now >= look_client) {
            gone = client_gone(c);
            look_client = now + OS_CLIENT_LOOK_NS;
        }
        if (now >= deadline || gone) {
            int given;
            os_lock();
            given = os_give_up(&s->q, t);
            os_unlock();
            return gone ? OS_HOLD_GONE : given ? OS_HOLD_GRANTED : OS_HOLD_TIMEOUT;
        }
        if ((now_repairs = __atomic_load_n(&os_shm->repairs, __ATOMIC_SEQ_CST)) != repairs) {
            /* a dead child's counts came back: the parent, which has no table, woke the held
             * requests to decide by theirs what the room starts */
            repairs = now_repairs;
            op_control_look();
            os_lock();
            os_epoch();
            os_unlock();
            continue;
        }
        if (os_follow_on && hold_expire(now, &wake)) {
            continue;
        }
        if (wake > look_client) {
            wake = look_client;
        }
        ts.tv_sec = (time_t)(wake / 1000000000);
        ts.tv_nsec = (long)(wake % 1000000000);
        /* absolute CLOCK_MONOTONIC deadline; wakes for this ticket's bit or a spurious one */
        syscall(SYS_futex, &s->q.wake, FUTEX_WAIT_BITSET, w, &ts, NULL, 1u << (t & 31));
    }
}

/* Wait for ticket t of stage s (OS_HOLD_*). */
static int hold(os_stage *s, uint32_t t, conn_rec *c)
{
    int64_t deadline = op_mono_ns() + (int64_t)(os_hold_s * 1e9);
    int how;
    __atomic_fetch_add(&s->sleepers, 1, __ATOMIC_SEQ_CST);  /* before the wake word is loaded: os_wake */
    how = hold_counted(s, t, deadline, c);
    __atomic_fetch_sub(&s->sleepers, 1, __ATOMIC_SEQ_CST);
    return how;
}

/* Hold request r (of q's stage, ticket t) until its turn, counted; it runs afterwards anyway,
 * unless its client went away (OS_HOLD_GONE: the caller drops it). */
static OP_COLD int hold_request(request_rec *r, const op_request_state *q, uint32_t t)
{
    os_stage *s = &os_shm->st[q->stage];
    int64_t t0 = op_mono_ns();
    int how;
    ADD(s->held, 1);
    how = hold(s, t, r->connection);
    if (how == OS_HOLD_TIMEOUT) {
        ADD(s->hold_timeouts, 1);
        ap_log_rerror(APLOG_MARK, APLOG_WARNING, 0, r, APLOGNO(90301) "mod_overtake_prio: a "
                      "request of stage %s waited OvertakeStageHold %g s for its turn; it runs "
                      "anyway", os_shm->names[q->stage], os_hold_s);
    }
    else if (how == OS_HOLD_GONE) {
        ADD(s->dropped, 1);
        ap_log_rerror(APLOG_MARK, APLOG_INFO, 0, r, APLOGNO(90307) "mod_overtake_prio: the client "
                      "of a held request of stage %s went away after %.3f s; it is dropped, not run",
                      os_shm->names[q->stage], (double)(op_mono_ns() - t0) / 1e9);
    }
    ADD(s->hold_ns, (apr_uint64_t)(op_mono_ns() - t0));
    return how;
}

/* ------------------------------------------------------------------------ the arrival */

/* The stage's name for the handler: CGI and FastCGI get it as OVERTAKE_STAGE (mod_proxy_fcgi
 * passes the request's environment as parameters), so the overtake_prio PHP extension counts
 * PHP-FPM's demotions by stage. A client cannot set it: its headers arrive as HTTP_*.
 * Only a request with a handler of the configuration's choosing gets it (SetHandler, AddHandler,
 * ProxyPass, ScriptAlias: set by the fixups, which run before this one), or with a content type
 * that old configurations use as a handler's name (AddType application/x-httpd-cgi ...): a
 * static file has neither, and nothing of it reads its environment, so it is spared the table
 * insertion, a visible share of the module's work on a tiny request. */
static void stage_env(request_rec *r, int stage)
{
    const char *ct = r->content_type;
    if (r->handler || (ct && ct[0] == 'a' && !strncmp(ct, "application/x-httpd-", 20))) {
        apr_table_setn(r->subprocess_env, "OVERTAKE_STAGE", os_shm->names[stage]);
    }
}

/* A request of no stage on a connection that holds a reservation: not the follow-up it was
 * kept for, so it is given up. */
static void not_staged(os_conn *oc)
{
    int res;
    if (!oc || oc->slot < 0) {
        return;
    }
    os_lock();
    if ((res = os_res_take(oc)) >= 0) {
        os_res_end((uint32_t)res, OS_RES_OTHER);
        os_epoch();
    }
    os_unlock();
}

/* Take a ticket of stage (lock held): the connection's reservation's if it is of this stage and
 * still due, else a new one. 1 with *ticket, or 0 if the queue is full (it runs at once). */
static int take_ticket(os_conn *oc, int stage, uint32_t *ticket)
{
    os_stage *s = &os_shm->st[stage];
    int res = os_res_take(oc);
    if (res >= 0 && (os_shm->res[res].stage != stage || os_shm->res[res].expires_ns <= op_mono_ns())) {
        os_res_end((uint32_t)res, os_shm->res[res].stage != stage ? OS_RES_OTHER : OS_RES_EXPIRED);
        os_epoch();
        res = -1;
    }
    if (res >= 0) {
        /* the follow-up takes its reservation's ticket over: started already, or waiting in
         * the place the reservation took */
        *ticket = os_shm->res[res].ticket;
        os_res_free((uint32_t)res, OS_RES_CLAIMED);
        s->q.owner[*ticket % OS_RING] = (uint16_t)(os_me + 1);
        return 1;
    }
    if (!os_enqueue(&s->q, ticket)) {
        s->q.active++;
        ADD(s->overflows, 1);
        return 0;
    }
    os_waiting_from(stage);
    s->q.owner[*ticket % OS_RING] = (uint16_t)(os_me + 1);  /* given back if this child dies */
    os_epoch();
    return 1;
}

/* The first request of an internal-redirect chain (counted once, in the stage first matched). */
static request_rec *first_request(request_rec *r)
{
    while (r->prev) {
        r = r->prev;
    }
    return r;
}

/* ------------------------------------------------------------------------ an HTTP/2 stream's end */

/* An HTTP/2 stream's request pool, whose cleanup ends its count, goes only when mod_http2's main
 * connection purges the finished stream (the end-of-request bucket waits in the stream's beam
 * till then), and that connection may be waiting for an event which only the stage's held
 * requests would make: they would wait OvertakeStageHold. So a stream's count ends at its EOS,
 * when its worker is done with it. */
static ap_filter_rec_t *stage_end_filter;

static apr_status_t stage_end_fn(ap_filter_t *f, apr_bucket_brigade *bb)
{
    op_request_state *st = f->ctx;
    if (st && !APR_BRIGADE_EMPTY(bb) && APR_BUCKET_IS_EOS(APR_BRIGADE_LAST(bb))) {
        f->ctx = NULL;
        if (st->stage >= 0) {
            op_stage_request_end(st);
            st->stage = -1;  /* the pool's cleanup has nothing left to end */
        }
        ap_remove_output_filter(f);
    }
    return ap_pass_brigade(f->next, bb);
}

void op_stage_insert_filter(request_rec *r)
{
    op_request_state *st;
    if (!r->connection->master || !os_shm || r->main) {
        return;  /* not an HTTP/2 stream: the pool's cleanup comes right after the log */
    }
    st = op_request_state_of(first_request(r));
    if (st && st->stage >= 0) {
        ap_add_output_filter_handle(stage_end_filter, st, r, r->connection);
    }
}

void op_stage_register_filter(void)
{
    /* after the content filters, as op_times.c's */
    stage_end_filter = ap_register_output_filter("OVERTAKE_STAGE_END", stage_end_fn, NULL,
                                                 AP_FTYPE_CONTENT_SET + 5);
}

OP_HOT int op_stage_fixups(request_rec *r)
{
    request_rec *r0;
    op_request_state *st;
    os_conn *oc;
    uint32_t ticket;
    int granted, queued, stage;
    if (!os_shm || r->main) {
        return DECLINED;  /* subrequests belong to their main request */
    }
    r0 = first_request(r);
    st = op_request_state_of(r0);
    if (st && st->stage >= 0) {
        stage_env(r, st->stage);  /* a redirect's env has it as REDIRECT_... */
        return DECLINED;
    }
    stage = os_stage_of(r);
    oc = os_follow_on ? os_conn_state(r->connection, 0) : NULL;
    if (stage < 0 || (uint32_t)stage >= os_shm->nstages) {
        not_staged(oc);
        return DECLINED;
    }
    stage_env(r, stage);
    ADD(os_shm->st[stage].requests, 1);
    st = st ? st : op_request_state_new(r0);  /* its cleanup ends the count: set below */
    if ((!oc || oc->slot < 0) && os_fast_arrive(stage)) {
        os_mine(stage, 1);
        st->stage = stage;
        return DECLINED;
    }
    os_lock();
    queued = take_ticket(oc, stage, &ticket);
    granted = !queued || os_started(&os_shm->st[stage].q, os_shm->st[stage].q.head, ticket);
    os_unlock();
    st->stage = stage;  /* counted running or waiting: the end completes it */
    if (!granted && hold_request(r, st, ticket) == OS_HOLD_GONE) {
        st->dropped = 1;
    }
    if (queued) {
        os_taken(&os_shm->st[stage].q, ticket);  /* first: a child killed in between leaves a count */
    }
    os_mine(stage, 1);
    if (st->dropped) {
        /* its handler never runs, and its count ends now (an HTTP/2 stream's pool may go only
         * later), which starts the next; no follow-up (the connection is done). Logged as nginx
         * logs a client that closed first: 499. */
        r->connection->keepalive = AP_CONN_CLOSE;
        r->connection->aborted = 1;
        op_stage_request_end(st);
        st->stage = -1;  /* the pool's cleanup has nothing left to end */
        return OS_CLIENT_CLOSED;
    }
    return DECLINED;
}
