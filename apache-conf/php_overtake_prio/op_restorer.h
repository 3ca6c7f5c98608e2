/*
 * overtake_prio's restorer: a process forked by the master at start-up, as root, that keeps the
 * privilege to raise a worker's priority back (CAP_SYS_NICE) which the workers drop. A worker asks
 * it over an abstract Unix datagram socket; the kernel's SCM_CREDENTIALS name the asking worker, so
 * a worker can restore only itself, and never above the master's own priority. It also keeps each
 * demoted worker's deadline (overtake_prio.max_demoted_ms) and restores the worker when it comes,
 * because a worker at SCHED_IDLE beside busy work may not run in time to do so itself.
 */
#ifndef OVERTAKE_PRIO_RESTORER_H
#define OVERTAKE_PRIO_RESTORER_H

#include <stdbool.h>
#include <sys/types.h>

/* internal to the extension: not exported from the shared object, where mod_php would put these
 * names beside Apache's modules' (mod_overtake_prio's are op_ too) */
#define OP_INTERNAL __attribute__((visibility("hidden")))

#define OP_RESTORE_NOW 0   /* restore the sender now and answer one byte (1: done) */
#define OP_RESTORE_AFTER 1 /* restore the sender after_ms from now unless it asks first; no answer */

/* Return pid (0: this process) to SCHED_OTHER (if idle) and nice; 0 on success. */
OP_INTERNAL int op_restore_pid(pid_t pid, int nice, bool idle);
/* In the master at start-up, as root: fork the restorer (nothing if not root or on failure). */
OP_INTERNAL void op_start_restorer(void);
/* In the master at shut-down: stop it. */
OP_INTERNAL void op_stop_restorer(void);
/* A restorer was started by this worker's master. */
OP_INTERNAL bool op_restorer_known(void);
/* In a worker: send the restorer a message (async-signal-safe: the timer's handler sends too). */
OP_INTERNAL bool op_tell_restorer(int kind, int after_ms, int nice, bool idle);
/* In a worker: ask to be restored now (which also drops its deadline); true once it is done. */
OP_INTERNAL bool op_ask_restorer(int nice, bool idle);

#endif
