dnl overtake_prio: per-request CPU priority by attained service in PHP workers
PHP_ARG_ENABLE([overtake_prio],
  [whether to enable overtake_prio],
  [AS_HELP_STRING([--enable-overtake_prio], [Enable overtake_prio])], [yes])

if test "$PHP_OVERTAKE_PRIO" != "no"; then
  PHP_CHECK_LIBRARY(rt, timer_create, [PHP_ADD_LIBRARY(rt, 1, OVERTAKE_PRIO_SHARED_LIBADD)])
  PHP_SUBST(OVERTAKE_PRIO_SHARED_LIBADD)
  PHP_NEW_EXTENSION(overtake_prio, overtake_prio.c op_restorer.c, $ext_shared,, -Wall -Wextra -Wno-unused-parameter -Werror)
fi
