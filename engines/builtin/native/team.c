/* The team barrier of team.h: a counter and a generation word; the last thread to arrive
 * bumps the generation, the others wait for it to change: spinning first (team->spin_ns), then
 * asleep on a futex (Linux; elsewhere they yield the CPU between looks). */
#define _GNU_SOURCE /* syscall() */

#include "team.h"

#include <limits.h>
#include <sched.h>
#include <time.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* engine.cpu_wait_policy=auto's budget. On a quiet machine the members of a decode step
 * arrive within a few microseconds of each other, and 2 us of spinning kept a step of
 * SmolLM2-135M (INT4, 2 threads, 2-core Zen 4) as fast as spinning for ever (4.1-4.2 vs
 * 3.9-4.0 ms; sleeping at once: 11.6-12.0 ms, a futex wake-up per barrier). On a busy one
 * every microsecond spun is taken from the process that shares the core, and the spinner loses
 * the wake-up priority a sleeper gets: with the other core kept busy the same step took 8.2-9.0
 * ms sleeping at once, 12-13 ms with 2 us, 15 ms with 10 us, 50 ms with 100 us (the team's size,
 * engines/builtin/team_size.py, answers that case: one thread, 6.5 ms). */
#define AUTO_SPIN_NS 2000

int64_t team_default_spin_ns(void) { return AUTO_SPIN_NS; }

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void sleep_while(_Atomic uint32_t *word, uint32_t value) {
#if defined(__linux__)
    /* the kernel checks *word == value before sleeping: a bump between our look and the call
     * returns at once (EAGAIN) instead of sleeping through it */
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
#else
    (void)word;
    (void)value;
    sched_yield();
#endif
}

static void wake_all(_Atomic uint32_t *word) {
#if defined(__linux__)
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#else
    (void)word;
#endif
}

/* Returns once *word != value: spins for spin_ns (TEAM_SPIN_FOREVER: for ever), then sleeps. */
static void wait_for_change(Team *team, _Atomic uint32_t *word, uint32_t value) {
    if (team->spin_ns != 0) {
        int64_t deadline = 0;
        for (uint32_t turn = 1;; turn++) {
            if (atomic_load_explicit(word, memory_order_acquire) != value) return;
            cpu_relax();
            if ((turn & 255) != 0 || team->spin_ns < 0) continue; /* the clock every 256 turns */
            const int64_t now = now_ns();
            if (deadline == 0) deadline = now + team->spin_ns;
            if (now >= deadline) break;
        }
    }
    /* sleepers is raised before the look at the word, and the waker bumps the word before it
     * reads sleepers (both sequentially consistent): one of the two sees the other */
    atomic_fetch_add(&team->sleepers, 1);
    while (atomic_load(word) == value) sleep_while(word, value);
    atomic_fetch_sub(&team->sleepers, 1);
}

void team_barrier(const Member *me) {
    if (me->size <= 1) return;
    Team *team = me->team;
    const uint32_t generation = atomic_load(&team->generation);
    if (atomic_fetch_add(&team->arrived, 1) + 1 == (uint32_t)me->size) {
        /* the others cannot arrive again until the generation moves: reset first */
        atomic_store(&team->arrived, 0);
        atomic_fetch_add(&team->generation, 1);
        if (atomic_load(&team->sleepers) > 0) wake_all(&team->generation);
        return;
    }
    wait_for_change(team, &team->generation, generation);
}
