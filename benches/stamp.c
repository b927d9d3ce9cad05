/* The benchmark's child: stamps CLOCK_MONOTONIC as its first and last
 * actions. Plain C, linked statically when possible, so that its own start-up
 * is as small as a child's can be and the figure is leaderrun's.
 *
 * It holds LEADERRUN_BENCH_HOLD_MS, then, with LEADERRUN_BENCH_GO (a FIFO),
 * until the harness opens the FIFO: the harness lets a term end only when
 * every replica waiting for the next one is known to be waiting. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/prctl.h>
#include <signal.h>
#include <unistd.h>
static void stamp(int fd, const char *kind) {
    struct timespec t; char buf[64];
    clock_gettime(CLOCK_MONOTONIC, &t);
    int n = snprintf(buf, sizeof buf, "%s %lld\n", kind, (long long)t.tv_sec * 1000000000LL + t.tv_nsec);
    write(fd, buf, n);
}
int main(void) {
    int fd = open(getenv("LEADERRUN_BENCH_STAMP"), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    stamp(fd, "start");
    const char *hold = getenv("LEADERRUN_BENCH_HOLD_MS");
    long ms = hold ? atol(hold) : 0;
    if (ms < 0) for (;;) pause();
    usleep(ms * 1000);
    const char *go = getenv("LEADERRUN_BENCH_GO");
    if (go) {
        /* A handover child dies with its tool when the harness clears up
         * (a killed flock or etcdctl would leave it waiting here). */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        close(open(go, O_RDONLY | O_CLOEXEC));
    }
    stamp(fd, "end");
    return 0;
}
