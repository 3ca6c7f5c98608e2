/*
 * og_fault.h -- loads from a shared file mapping that survive the file shrinking under them.
 *
 * A page of a MAP_SHARED file mapping that lies beyond the file's end raises SIGBUS when it is
 * touched: a `truncate` of the admission gate's file killed every Apache child waiting on it.
 * og_load touches the mapping only inside a window in which the SIGBUS handler jumps back and
 * the load reports failure; the caller then treats the file as gone. Any other SIGBUS goes on
 * to the disposition installed before (Apache's core-dump handler, or the default).
 *
 * The handler runs with SA_NODEFER: sigsetjmp(..., 0) does not save the signal mask (a system
 * call per load otherwise), so after the jump SIGBUS must not stay blocked in the thread.
 * Threads that block every signal (the module's own) must unblock SIGBUS before they load: a
 * blocked synchronous SIGBUS kills the process whatever the handler.
 * Checked by tests/controller/harness/test_gate_fault.py.
 */
#ifndef OG_FAULT_H
#define OG_FAULT_H

#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>

static __thread sigjmp_buf *volatile og_fault_jmp __attribute__((tls_model("initial-exec")));
static struct sigaction og_fault_prev;
static int og_fault_installed;

static void og_fault_handler(int sig, siginfo_t *si, void *uc)
{
    sigjmp_buf *jb = og_fault_jmp;
    if (jb && si->si_code > 0) {  /* a fault of the guarded load (not a kill(2) of SIGBUS) */
        og_fault_jmp = NULL;
        siglongjmp(*jb, 1);
    }
    if (og_fault_prev.sa_flags & SA_SIGINFO) {
        og_fault_prev.sa_sigaction(sig, si, uc);
    }
    else if (og_fault_prev.sa_handler != SIG_DFL && og_fault_prev.sa_handler != SIG_IGN) {
        og_fault_prev.sa_handler(sig);
    }
    else {
        /* the default: put it back; a fault raises it again when the instruction re-runs, a
         * signal sent by someone is raised again here */
        sigaction(sig, &og_fault_prev, NULL);
        if (si->si_code <= 0) {
            raise(sig);
        }
    }
}

/* Install the handler once per process (the caller serialises); 0 if sigaction refused. */
static int og_fault_install(void)
{
    struct sigaction sa;
    if (og_fault_installed) {
        return 1;
    }
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = og_fault_handler;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &og_fault_prev) != 0) {
        return 0;
    }
    og_fault_installed = 1;
    return 1;
}

/* *out = *w (acquire order); 0 when the word's page is gone (the file shrank under the mapping).
 * og_fault_install must have succeeded. */
static int og_load(const uint32_t *w, uint32_t *out)
{
    sigjmp_buf jb;
    if (sigsetjmp(jb, 0)) {
        return 0;
    }
    og_fault_jmp = &jb;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    *out = __atomic_load_n(w, __ATOMIC_ACQUIRE);
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    og_fault_jmp = NULL;
    return 1;
}

#endif
