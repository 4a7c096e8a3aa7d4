/* A team of threads working through a sequence of dependent ops inside ONE parallel region,
 * with a barrier of its own between the ops (team.c).
 *
 * Why not OpenMP's barriers: inferlab runs libgomp with OMP_WAIT_POLICY=PASSIVE (engines/
 * openmp.py), under which every parallel region and every barrier puts the waiting threads to
 * sleep at once, and waking one costs ~30 us on a VM. A decode step of SmolLM2-135M chains ~270
 * kernels; one region each made two threads slower than one (issue 36). Here the step is one
 * region (one wake-up), and at each barrier a thread first spins for a while, then sleeps on a
 * futex: on a quiet machine the others arrive within microseconds and nobody sleeps; on a busy
 * one a thread waiting for a descheduled partner gives its core back instead of spinning through
 * the partner's time slice (llama.cpp's pool sleeps between graphs, but its barriers only spin).
 * How many threads the team takes is the caller's (engines/builtin/team_size.py measures it). */
#ifndef INFERLAB_TEAM_H
#define INFERLAB_TEAM_H

#include <stdatomic.h>
#include <stdint.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

/* How a thread waits at a barrier: spin this many nanoseconds, then sleep until woken.
 * TEAM_SPIN_FOREVER never sleeps (OpenMP's ACTIVE); 0 sleeps at once (PASSIVE). */
#define TEAM_SPIN_FOREVER (-1)

typedef struct {
    _Atomic uint32_t arrived;    /* members at the barrier in this generation */
    _Atomic uint32_t generation; /* the futex word: bumped when the last one arrives */
    _Atomic uint32_t sleepers;   /* members asleep (or about to be) on `generation` */
    int64_t spin_ns;
} Team;

/* One thread's view of its team: who it is (0 .. size - 1) among how many. */
typedef struct {
    Team *team;
    int64_t id, size;
} Member;

/* The calling thread as a member of `team`: inside a parallel region, its OpenMP thread number
 * among the region's threads (which is what every member must agree on); outside, alone. */
static inline Member team_member(Team *team) {
#if defined(_OPENMP)
    return (Member){team, omp_get_thread_num(), omp_get_num_threads()};
#else
    return (Member){team, 0, 1};
#endif
}

/* Waits until every member has called it (returns at once for a team of one). What a member
 * wrote before it is visible to every member after it. */
void team_barrier(const Member *me);

/* This member's share [*lo, *hi) of n items: contiguous, sizes differing by at most one. */
static inline void team_share(int64_t n, const Member *me, int64_t *lo, int64_t *hi) {
    const int64_t base = n / me->size, extra = n % me->size;
    *lo = me->id * base + (me->id < extra ? me->id : extra);
    *hi = *lo + base + (me->id < extra ? 1 : 0);
}

/* The spin budget the engine's C kernels use where the caller does not pass one: the
 * decode program's default (engine.cpu_wait_policy=auto; engines/builtin/native/team.c). */
int64_t team_default_spin_ns(void);

#endif
