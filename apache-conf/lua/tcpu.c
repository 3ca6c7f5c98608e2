/*
 * tcpu: the calling thread's CPU clock for Lua 5.3 (CLOCK_THREAD_CPUTIME_ID).
 *
 * Why C: Lua's os.clock() is C clock(), i.e. CPU time of the whole *process*; under mpm_event
 * all worker threads live in one child, so it counts every concurrent request. Reading
 * /proc/thread-self/schedstat is only tick-accurate (+-4 ms at HZ=250).
 * Built by controller/apache.py into <workdir>/luac/tcpu.so:
 *   gcc -O2 -shared -fPIC -I/usr/include/lua5.3 -o tcpu.so tcpu.c
 */
#include <time.h>
#include <lua.h>
#include <lauxlib.h>

static int read_clock(lua_State *L, struct timespec *ts)
{
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, ts) != 0)
        return luaL_error(L, "tcpu: clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    return 0;
}

/* tcpu.now_ns() -> integer nanoseconds of CPU used by this thread (exact, no rounding). */
static int l_now_ns(lua_State *L)
{
    struct timespec ts;
    read_clock(L, &ts);
    lua_pushinteger(L, (lua_Integer)ts.tv_sec * 1000000000 + (lua_Integer)ts.tv_nsec);
    return 1;
}

/* tcpu.now() -> seconds as a float, for convenience. */
static int l_now(lua_State *L)
{
    struct timespec ts;
    read_clock(L, &ts);
    lua_pushnumber(L, (lua_Number)ts.tv_sec + (lua_Number)ts.tv_nsec * 1e-9);
    return 1;
}

static const luaL_Reg tcpu_funcs[] = {
    {"now_ns", l_now_ns},
    {"now", l_now},
    {NULL, NULL},
};

int luaopen_tcpu(lua_State *L)
{
    luaL_newlib(L, tcpu_funcs);
    return 1;
}
