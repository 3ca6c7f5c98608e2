/*
 * op_stage_follow.c -- module mode's follow-up reservations (OvertakeStageNext).
 *
 * Tandem routing (van der Weij et al.: a request leaving stage i joins queue i+1 at that instant):
 * with `OvertakeStageNext FIRST SECOND`, a request of FIRST that ends on a keep-alive HTTP/1
 * connection leaves a reservation for the connection's next request in SECOND's queue before the
 * completing worker decides, as the sidecar's limiter does, so the decision sees the request that
 * moves on. The reservation takes a ticket like an arrival (it waits, or is started and holds its
 * slot idle). The connection's next request of SECOND takes the ticket over (it runs at once if
 * the ticket was started, else it waits on it); any other request on the connection, the
 * connection's close, or `OvertakeStageFollowUp` seconds without a request give it up (counted
 * by outcome). Without it the client's round trip lets a newcomer of SECOND take the slot first.
 * Expiry is checked at every decision and status read, and a held request wakes at least once
 * per follow-up timeout while reservations exist, so an expired one never blocks a start for
 * long when nothing else happens.
 *
 * Every function but os_conn_state runs under the stages' lock (op_stage_decide.c).
 */
#include "mod_overtake_prio.h"

#include <stdint.h>

#include "op_stage.h"

#define OS_CONN_KEY "overtake-stage-follow"  /* on the connection's pool: its os_conn */

/* Free reservation slot i, ended by outcome; its ticket stays where it is. */
void os_res_free(uint32_t i, int outcome)
{
    os_res *v = &os_shm->res[i];
    os_shm->st[v->stage].reserved--;
    ADD(os_shm->st[v->stage].res_ended[outcome], 1);
    v->stage = -1;
    v->gen++;  /* the connection that held it no longer finds it */
    os_shm->nres--;
    while (os_shm->res_hi && os_shm->res[os_shm->res_hi - 1].stage < 0) {
        os_shm->res_hi--;
    }
}

/* Give reservation slot i up: a started ticket frees its slot, a waiting one is skipped by the
 * grants. The caller decides next. */
void os_res_end(uint32_t i, int outcome)
{
    os_queue *q = &os_shm->st[os_shm->res[i].stage].q;
    uint32_t t = os_shm->res[i].ticket;
    if (os_started(q, q->head, t)) {
        os_complete(q);
    }
    else {
        q->gone[t % OS_RING] = 1;
        q->waiting--;
    }
    os_res_free(i, outcome);
}

/* Give up the reservations whose follow-up did not come in time; how many. */
int os_res_expire(int64_t now)
{
    int64_t due = INT64_MAX;
    uint32_t i;
    int n = 0;
    if (!os_shm->nres || now < os_shm->res_due) {
        return 0;
    }
    for (i = 0; i < os_shm->res_hi; i++) {
        const os_res *v = &os_shm->res[i];
        if (v->stage < 0) {
            continue;
        }
        if (v->expires_ns <= now) {
            os_res_end(i, OS_RES_EXPIRED);
            n++;
        }
        else if (v->expires_ns < due) {
            due = v->expires_ns;
        }
    }
    os_shm->res_due = due;
    return n;
}

/* The reservation the connection still holds, taken from it: its slot, or -1. */
int os_res_take(os_conn *oc)
{
    int i;
    if (!oc || oc->slot < 0) {
        return -1;
    }
    i = oc->slot;
    oc->slot = -1;
    return os_shm->res[i].stage >= 0 && os_shm->res[i].gen == oc->gen ? i : -1;
}

/* Reserve a ticket of stage for the connection's next request (before the decision): 0 if every
 * slot or the stage's ticket ring is in use (no reservation: the follow-up arrives as a
 * newcomer). */
int os_res_make(os_conn *oc, int stage, int64_t now)
{
    os_stage *s = &os_shm->st[stage];
    os_res *v;
    uint32_t i, t;
    for (i = 0; i < os_shm->res_hi && os_shm->res[i].stage >= 0; i++) {
    }
    if (i == OS_MAX_RES || !os_enqueue(&s->q, &t)) {
        ADD(s->res_full, 1);
        return 0;
    }
    os_waiting_from(stage);
    v = &os_shm->res[i];
    v->stage = stage;
    v->ticket = t;
    v->expires_ns = now + os_shm->follow_ns;
    if (i == os_shm->res_hi) {
        os_shm->res_hi++;
    }
    os_shm->res_due = os_shm->nres++ && os_shm->res_due < v->expires_ns ? os_shm->res_due : v->expires_ns;
    s->reserved++;
    ADD(s->reservations, 1);
    oc->slot = (int)i;
    oc->gen = v->gen;
    return 1;
}

/* The connection closed: its reservation, if any, is given up (takes the lock). */
static apr_status_t conn_closed(void *data)
{
    os_conn *oc = data;
    int i;
    if (oc->slot < 0) {
        return APR_SUCCESS;
    }
    os_lock();
    if ((i = os_res_take(oc)) >= 0) {
        os_res_end((uint32_t)i, OS_RES_CLOSED);
        os_epoch();
    }
    os_unlock();
    return APR_SUCCESS;
}

/* The connection's reservation state (created with the cleanup that gives it up on close); no
 * lock needed: a connection is served by one thread at a time. */
os_conn *os_conn_state(conn_rec *c, int create)
{
    void *oc = NULL;
    if (apr_pool_userdata_get(&oc, OS_CONN_KEY, c->pool) == APR_SUCCESS && oc) {
        return oc;
    }
    if (!create) {
        return NULL;
    }
    oc = apr_palloc(c->pool, sizeof(os_conn));
    ((os_conn *)oc)->slot = -1;
    apr_pool_userdata_setn(oc, OS_CONN_KEY, NULL, c->pool);
    apr_pool_cleanup_register(c->pool, oc, conn_closed, apr_pool_cleanup_null);
    return oc;
}
