/*
 * test_io.c: the bounded I/O worker of kvtier/io.h: identical operations
 * coalesce (16 threads asking for one restore produce one read), cancelling
 * every waiter discards an operation (before it starts: it never runs;
 * after: its result is dropped), a full queue refuses in operations and in
 * bytes, foreground runs before background, run errors reach every waiter,
 * and a randomized mix of submit / wait / cancel / release from several
 * threads ends with every task freed exactly once (run under TSan too).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <pthread.h>
#include <unistd.h>

#include "internal.h" /* kvt__fail, kvt__clear_error: a run's message as the library's runs set it */
#include "kvtier/io.h"
#include "test_seed.h"

/* A gate a running operation blocks on until the test opens it. */
typedef struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int open;
    int entered; /* runs that reached the gate */
} gate;

static void gate_init(gate *g)
{
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->open = 0;
    g->entered = 0;
}

static void gate_pass(gate *g)
{
    pthread_mutex_lock(&g->mu);
    g->entered++;
    pthread_cond_broadcast(&g->cv);
    while (!g->open)
        pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

static void gate_wait_entered(gate *g, int n)
{
    pthread_mutex_lock(&g->mu);
    while (g->entered < n)
        pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

static void gate_open(gate *g)
{
    pthread_mutex_lock(&g->mu);
    g->open = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static void gate_destroy(gate *g)
{
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
}

/* Counters shared by the tasks of one test. */
typedef struct counts {
    int runs[64];     /* by task id (atomic) */
    int order[64];    /* ids in the order they ran */
    int n_order;      /* atomic */
    int freed_tasks;  /* atomic: free_fn calls */
    int freed_result; /* atomic: free_fn calls with a result */
} counts;

typedef struct task {
    counts *c;
    gate *g; /* NULL: no gate */
    int id;
    int fail;        /* run returns this */
    const char *msg; /* with fail: the message the run sets (kvt__fail) */
} task;

static int task_run(void *arg, void **result)
{
    task *t = arg;
    __atomic_fetch_add(&t->c->runs[t->id], 1, __ATOMIC_SEQ_CST);
    int slot = __atomic_fetch_add(&t->c->n_order, 1, __ATOMIC_SEQ_CST);
    if (slot < 64)
        t->c->order[slot] = t->id;
    if (t->g)
        gate_pass(t->g);
    if (t->fail && t->msg)
        return kvt__fail(t->fail, "%s (task %d)", t->msg, t->id);
    if (t->fail)
        return t->fail;
    int *r = malloc(sizeof *r);
    *r = 1000 + t->id;
    *result = r;
    return 0;
}

static void task_free(void *arg, void *result)
{
    task *t = arg;
    __atomic_fetch_add(&t->c->freed_tasks, 1, __ATOMIC_SEQ_CST);
    if (result)
        __atomic_fetch_add(&t->c->freed_result, 1, __ATOMIC_SEQ_CST);
    free(result);
    free(t);
}

static kvt_io_op make_op(counts *c, gate *g, int id, kvt_io_kind kind, uint64_t key, kvt_io_priority prio,
                         uint64_t bytes)
{
    task *t = malloc(sizeof *t);
    *t = (task){c, g, id, 0, NULL};
    return (kvt_io_op){.kind = kind,
                       .key = {key, key * 0x9e3779b97f4a7c15ull},
                       .priority = prio,
                       .bytes = bytes,
                       .run = task_run,
                       .free_fn = task_free,
                       .task = t};
}

static kvt_io *new_io(int threads, uint32_t max_ops, uint64_t max_bytes)
{
    kvt_io_options o = {.threads = threads, .max_ops = max_ops, .max_bytes = max_bytes};
    kvt_io *io = NULL;
    assert_int_equal(kvt_io_create(&o, &io), 0);
    return io;
}

/* submits a gated operation and waits until it runs (it holds one thread) */
static kvt_io_ticket *block_thread(kvt_io *io, counts *c, gate *g, int id)
{
    kvt_io_op op = make_op(c, g, id, KVT_IO_KIND_WRITE, 0xdead0000u + (uint64_t)id, KVT_IO_BACKGROUND, 0);
    kvt_io_ticket *t = NULL;
    assert_int_equal(kvt_io_submit(io, &op, &t), 0);
    gate_wait_entered(g, 1);
    return t;
}

/* ---- 16 threads ask for the same restore: one read ----------------------- */

typedef struct same {
    kvt_io *io;
    counts *c;
    gate *g;
    int rc[16];
    int disp[16];
    int value[16];
} same;

typedef struct same_arg {
    same *s;
    int i;
} same_arg;

static void *same_thread(void *arg)
{
    same_arg *a = arg;
    same *s = a->s;
    kvt_io_op op = make_op(s->c, s->g, 1, KVT_IO_KIND_RESTORE, 42, KVT_IO_FOREGROUND, 4096);
    kvt_io_ticket *t = NULL;
    s->rc[a->i] = kvt_io_submit(s->io, &op, &t);
    if (s->rc[a->i])
        return NULL;
    kvt_io_disposition d = KVT_IO_DISCARD;
    void *r = NULL;
    s->rc[a->i] = kvt_io_wait(t, UINT64_MAX, &d, &r);
    s->disp[a->i] = d;
    s->value[a->i] = r ? *(int *)r : -1;
    kvt_io_ticket_release(t);
    return NULL;
}

static void test_sixteen_one_read(void **state)
{
    (void)state;
    counts c = {0};
    gate g;
    gate_init(&g);
    kvt_io *io = new_io(4, 64, 1 << 20);
    same s = {.io = io, .c = &c, .g = &g};
    pthread_t th[16];
    same_arg args[16];
    for (int i = 0; i < 16; i++) {
        args[i] = (same_arg){&s, i};
        assert_int_equal(pthread_create(&th[i], NULL, same_thread, &args[i]), 0);
    }
    /* the read stays in its gate until all 16 submitted */
    for (;;) {
        kvt_io_stats st;
        kvt_io_stats_get(io, &st);
        if (st.submitted == 16)
            break;
        usleep(1000);
    }
    gate_open(&g);
    for (int i = 0; i < 16; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 16; i++) {
        assert_int_equal(s.rc[i], 0);
        assert_int_equal(s.disp[i], KVT_IO_PUBLISH);
        assert_int_equal(s.value[i], 1001);
    }
    kvt_io_stats st;
    kvt_io_stats_get(io, &st);
    print_message("16 threads, one restore: %d read, %llu ran, %llu coalesced of %llu submitted\n", c.runs[1],
                  (unsigned long long)st.ran, (unsigned long long)st.coalesced, (unsigned long long)st.submitted);
    assert_int_equal(c.runs[1], 1);
    assert_int_equal(st.ran, 1);
    assert_int_equal(st.coalesced, 15);
    assert_int_equal(st.submitted, 16);
    assert_int_equal(c.freed_tasks, 16); /* 15 coalesced tasks freed at submit, the op's at the end */
    assert_int_equal(c.freed_result, 1);
    kvt_io_destroy(io);
    gate_destroy(&g);
}

/* ---- cancelling every waiter ---------------------------------------------- */

static void test_cancel_all(void **state)
{
    (void)state;
    counts c = {0};
    gate g, g2;
    gate_init(&g);
    gate_init(&g2);
    kvt_io *io = new_io(1, 64, 1 << 20);
    kvt_io_ticket *blocker = block_thread(io, &c, &g, 0);

    /* queued, not started: cancelling all four waiters discards it */
    kvt_io_ticket *t[4];
    for (int i = 0; i < 4; i++) {
        kvt_io_op op = make_op(&c, NULL, 2, KVT_IO_KIND_RESTORE, 7, KVT_IO_FOREGROUND, 100);
        assert_int_equal(kvt_io_submit(io, &op, &t[i]), 0);
    }
    kvt_io_stats st;
    kvt_io_stats_get(io, &st);
    assert_int_equal(st.queued_ops, 1);
    assert_int_equal(st.queued_bytes, 100);
    for (int i = 0; i < 3; i++)
        kvt_io_cancel(t[i]);
    kvt_io_stats_get(io, &st);
    assert_int_equal(st.queued_ops, 1); /* one waiter left */
    assert_int_equal(st.discarded, 0);
    kvt_io_cancel(t[3]);
    kvt_io_cancel(t[3]); /* twice: no effect */
    kvt_io_stats_get(io, &st);
    assert_int_equal(st.queued_ops, 0);
    assert_int_equal(st.queued_bytes, 0);
    assert_int_equal(st.discarded, 1);
    kvt_io_disposition d = KVT_IO_PUBLISH;
    void *r = (void *)&d;
    assert_int_equal(kvt_io_wait(t[0], 0, &d, &r), KVT_ECANCELED);
    assert_int_equal(d, KVT_IO_DISCARD);
    assert_null(r);
    assert_int_equal(c.freed_tasks, 3); /* the coalesced ones */
    for (int i = 0; i < 4; i++)
        kvt_io_ticket_release(t[i]);
    assert_int_equal(c.freed_tasks, 4);
    assert_int_equal(c.freed_result, 0);

    /* started: cancelling both waiters discards the result on completion */
    kvt_io_op op = make_op(&c, &g2, 3, KVT_IO_KIND_RESTORE, 8, KVT_IO_FOREGROUND, 100);
    kvt_io_ticket *u[2];
    assert_int_equal(kvt_io_submit(io, &op, &u[0]), 0);
    op = make_op(&c, &g2, 3, KVT_IO_KIND_RESTORE, 8, KVT_IO_FOREGROUND, 100);
    assert_int_equal(kvt_io_submit(io, &op, &u[1]), 0);
    gate_open(&g); /* the blocker ends; the restore starts and blocks in g2 */
    gate_wait_entered(&g2, 1);
    kvt_io_cancel(u[0]);
    kvt_io_cancel(u[1]);
    gate_open(&g2);
    assert_int_equal(kvt_io_flush(io, 10000), 0);
    assert_int_equal(kvt_io_wait(u[1], 0, &d, &r), KVT_ECANCELED);
    assert_int_equal(d, KVT_IO_DISCARD);
    kvt_io_stats_get(io, &st);
    print_message("cancel every waiter: queued one discarded unrun (discarded %llu, its read ran %d times); "
                  "running one's result discarded (results_discarded %llu)\n", (unsigned long long)st.discarded,
                  c.runs[2], (unsigned long long)st.results_discarded);
    assert_int_equal(st.results_discarded, 1);
    assert_int_equal(c.runs[2], 0); /* the discarded restore never read */
    assert_int_equal(c.runs[3], 1);
    kvt_io_ticket_release(u[0]);
    kvt_io_ticket_release(u[1]);
    kvt_io_ticket_release(blocker);
    assert_int_equal(c.freed_result, 2); /* the blocker's and the discarded result */
    kvt_io_destroy(io);
    assert_int_equal(c.freed_tasks, 7);
    gate_destroy(&g);
    gate_destroy(&g2);
}

/* ---- a full queue refuses ------------------------------------------------- */

static void test_full_queue(void **state)
{
    (void)state;
    counts c = {0};
    gate g;
    gate_init(&g);
    kvt_io *io = new_io(1, 3, 1000);
    kvt_io_ticket *blocker = block_thread(io, &c, &g, 0); /* 1 of 3 operations */
    kvt_io_ticket *a = NULL, *b = NULL, *x = NULL, *a2 = NULL;
    kvt_io_op op = make_op(&c, NULL, 1, KVT_IO_KIND_RESTORE, 1, KVT_IO_FOREGROUND, 600);
    assert_int_equal(kvt_io_submit(io, &op, &a), 0);
    /* bytes: 600 of 1000 queued, 500 more does not fit; 1001 never fits */
    op = make_op(&c, NULL, 2, KVT_IO_KIND_RESTORE, 2, KVT_IO_FOREGROUND, 500);
    assert_int_equal(kvt_io_submit(io, &op, &x), KVT_EAGAIN);
    assert_null(x);
    assert_non_null(strstr(kvt_last_error(), "600 of 1000 bytes"));
    op.bytes = 1001;
    assert_int_equal(kvt_io_submit(io, &op, &x), KVT_ETOOBIG);
    op.bytes = 400;
    assert_int_equal(kvt_io_submit(io, &op, &b), 0); /* 3 of 3 operations, 1000 of 1000 bytes */
    /* operations: a fourth distinct one is refused, the caller keeps its task */
    kvt_io_op op4 = make_op(&c, NULL, 3, KVT_IO_KIND_WRITE, 3, KVT_IO_BACKGROUND, 0);
    assert_int_equal(kvt_io_submit(io, &op4, &x), KVT_EAGAIN);
    print_message("full queue: %s\n", kvt_last_error());
    assert_non_null(strstr(kvt_last_error(), "3 of 3 operations"));
    assert_int_equal(kvt_io_submit(io, &op4, NULL), KVT_EAGAIN);
    task_free(op4.task, NULL);
    /* an identical one coalesces even when full: it adds nothing */
    op = make_op(&c, NULL, 1, KVT_IO_KIND_RESTORE, 1, KVT_IO_FOREGROUND, 600);
    assert_int_equal(kvt_io_submit(io, &op, &a2), 0);
    /* the same key with another kind is another operation: refused */
    op = make_op(&c, NULL, 4, KVT_IO_KIND_PREFETCH, 1, KVT_IO_BACKGROUND, 0);
    assert_int_equal(kvt_io_submit(io, &op, &x), KVT_EAGAIN);
    task_free(op.task, NULL);
    kvt_io_stats st;
    kvt_io_stats_get(io, &st);
    assert_int_equal(st.refused, 4);
    assert_int_equal(st.coalesced, 1);
    assert_int_equal(st.max_queued_ops, 3);
    assert_int_equal(st.queued_bytes, 1000);
    gate_open(&g);
    kvt_io_disposition d;
    void *r;
    assert_int_equal(kvt_io_wait(a, 10000, &d, &r), 0);
    assert_int_equal(d, KVT_IO_PUBLISH);
    assert_int_equal(*(int *)r, 1001);
    assert_int_equal(kvt_io_wait(a2, 10000, &d, &r), 0);
    assert_int_equal(*(int *)r, 1001);
    assert_int_equal(kvt_io_wait(b, 10000, &d, &r), 0);
    assert_int_equal(*(int *)r, 1002);
    assert_int_equal(c.runs[1], 1);
    kvt_io_ticket_release(a);
    kvt_io_ticket_release(a2);
    kvt_io_ticket_release(b);
    kvt_io_ticket_release(blocker);
    /* room again */
    op = make_op(&c, NULL, 5, KVT_IO_KIND_WRITE, 5, KVT_IO_BACKGROUND, 1000);
    assert_int_equal(kvt_io_submit(io, &op, NULL), 0);
    assert_int_equal(kvt_io_flush(io, 10000), 0);
    assert_int_equal(c.runs[5], 1);
    kvt_io_destroy(io);
    assert_int_equal(c.freed_tasks, 7);
    gate_destroy(&g);
}

/* ---- foreground before background -------------------------------------------- */

static void test_priority_order(void **state)
{
    (void)state;
    counts c = {0};
    gate g;
    gate_init(&g);
    kvt_io *io = new_io(1, 64, 1 << 20);
    kvt_io_ticket *blocker = block_thread(io, &c, &g, 0);
    struct {
        int id;
        kvt_io_kind kind;
        uint64_t key;
        kvt_io_priority prio;
    } sub[] = {
        {1, KVT_IO_KIND_WRITE, 10, KVT_IO_BACKGROUND},    {2, KVT_IO_KIND_WRITE, 11, KVT_IO_BACKGROUND},
        {3, KVT_IO_KIND_RESTORE, 20, KVT_IO_FOREGROUND},  {4, KVT_IO_KIND_PREFETCH, 30, KVT_IO_BACKGROUND},
        {5, KVT_IO_KIND_WRITE, 12, KVT_IO_BACKGROUND},    {6, KVT_IO_KIND_RESTORE, 21, KVT_IO_FOREGROUND},
        {4, KVT_IO_KIND_PREFETCH, 30, KVT_IO_FOREGROUND}, /* a request now waits for the prefetch: promoted */
    };
    for (size_t i = 0; i < sizeof sub / sizeof sub[0]; i++) {
        kvt_io_op op = make_op(&c, NULL, sub[i].id, sub[i].kind, sub[i].key, sub[i].prio, 10);
        assert_int_equal(kvt_io_submit(io, &op, NULL), 0);
    }
    gate_open(&g);
    assert_int_equal(kvt_io_flush(io, 10000), 0);
    int want[] = {0, 3, 6, 4, 1, 2, 5};
    print_message("priority order: %d,%d,%d,%d,%d,%d,%d (foreground 3, 6, promoted prefetch 4, then background "
                  "1, 2, 5)\n", c.order[0], c.order[1], c.order[2], c.order[3], c.order[4], c.order[5], c.order[6]);
    assert_int_equal(c.n_order, 7);
    for (int i = 0; i < 7; i++)
        assert_int_equal(c.order[i], want[i]);
    kvt_io_ticket_release(blocker);
    kvt_io_destroy(io);
    assert_int_equal(c.freed_tasks, 8);
    gate_destroy(&g);
}


/* ---- notify waiters, running here, the background bound, the default --------- */

typedef struct told {
    pthread_mutex_t mu;
    int n, status[8], disp[8], value[8];
} told;

static told g_told = {PTHREAD_MUTEX_INITIALIZER, 0, {0}, {0}, {0}};

static void tell(void *arg, int status, kvt_io_disposition d, void *result)
{
    (void)arg;
    pthread_mutex_lock(&g_told.mu);
    int i = g_told.n++;
    if (i < 8) {
        g_told.status[i] = status;
        g_told.disp[i] = d;
        g_told.value[i] = result ? *(int *)result : -1;
    }
    pthread_mutex_unlock(&g_told.mu);
}

/* Three notify waiters and a ticket on one operation: one run, each told
 * once with the shared result; cancelling the ticket does not discard an
 * operation notify waiters hold; a flush returns after every notify; a
 * worker destroyed first tells a queued operation's waiters KVT_ECLOSED. */
static void test_notify(void **state)
{
    (void)state;
    counts c = {0};
    gate g;
    gate_init(&g);
    kvt_io *io = new_io(1, 64, 1 << 20);
    kvt_io_ticket *blocker = block_thread(io, &c, &g, 0);
    g_told.n = 0;
    for (int i = 0; i < 3; i++) {
        kvt_io_op op = make_op(&c, NULL, 1, KVT_IO_KIND_RESTORE, 77, KVT_IO_FOREGROUND, 10);
        assert_int_equal(kvt_io_submit_notify(io, &op, tell, NULL), 0);
    }
    kvt_io_op op = make_op(&c, NULL, 1, KVT_IO_KIND_RESTORE, 77, KVT_IO_FOREGROUND, 10);
    kvt_io_ticket *t = NULL;
    assert_int_equal(kvt_io_submit(io, &op, &t), 0);
    kvt_io_cancel(t); /* the notify waiters still want it */
    kvt_io_ticket_release(t);
    op = make_op(&c, NULL, 2, KVT_IO_KIND_RESTORE, 78, KVT_IO_FOREGROUND, 10);
    assert_int_equal(kvt_io_submit_notify(io, &op, NULL, NULL), KVT_EINVAL);
    task_free(op.task, NULL);
    gate_open(&g);
    assert_int_equal(kvt_io_flush(io, 10000), 0);
    assert_int_equal(g_told.n, 3); /* all told before the flush returned */
    for (int i = 0; i < 3; i++) {
        assert_int_equal(g_told.status[i], 0);
        assert_int_equal(g_told.disp[i], KVT_IO_PUBLISH);
        assert_int_equal(g_told.value[i], 1001);
    }
    assert_int_equal(c.runs[1], 1);
    kvt_io_stats st;
    kvt_io_stats_get(io, &st);
    assert_int_equal(st.by_kind[KVT_IO_KIND_RESTORE].coalesced, 3);
    assert_int_equal(st.by_kind[KVT_IO_KIND_RESTORE].ran, 1);
    assert_int_equal(st.discarded, 0);
    kvt_io_ticket_release(blocker);
    /* destroyed with a notify waiter queued: told KVT_ECLOSED, task freed */
    gate g2;
    gate_init(&g2);
    blocker = block_thread(io, &c, &g2, 3);
    g_told.n = 0;
    op = make_op(&c, NULL, 4, KVT_IO_KIND_RESTORE, 79, KVT_IO_FOREGROUND, 10);
    assert_int_equal(kvt_io_submit_notify(io, &op, tell, NULL), 0);
    kvt_io_ticket_release(blocker); /* cancelled, still running in its gate */
    gate_open(&g2);
    assert_int_equal(kvt_io_flush(io, 10000), 0);
    assert_int_equal(g_told.n, 1);
    assert_int_equal(g_told.status[0], 0); /* it ran after the blocker */
    gate g3;
    gate_init(&g3);
    blocker = block_thread(io, &c, &g3, 5);
    g_told.n = 0;
    op = make_op(&c, NULL, 6, KVT_IO_KIND_RESTORE, 80, KVT_IO_FOREGROUND, 10);
    assert_int_equal(kvt_io_submit_notify(io, &op, tell, NULL), 0);
    kvt_io_ticket_release(blocker);
    gate_open(&g3); /* racing the destroy: told 0 (ran) or KVT_ECLOSED (discarded) */
    kvt_io_destroy(io);
    assert_int_equal(g_told.n, 1);
    assert_true(g_told.status[0] == 0 || g_told.status[0] == KVT_ECLOSED);
    assert_int_equal(g_told.disp[0], g_told.status[0] ? KVT_IO_DISCARD : KVT_IO_PUBLISH);
    assert_int_equal(c.freed_tasks, 10);
    gate_destroy(&g);
    gate_destroy(&g2);
    gate_destroy(&g3);
}

/* A queued operation runs on the thread that needs it (kvt_io_run_here)
 * while every worker thread is busy; once started or done it is a no-op. */
static void test_run_here(void **state)
{
    (void)state;
    counts c = {0};
    gate g;
    gate_init(&g);
    kvt_io *io = new_io(1, 64, 1 << 20);
    kvt_io_ticket *blocker = block_thread(io, &c, &g, 0);
    kvt_io_op op = make_op(&c, NULL, 1, KVT_IO_KIND_HASH, 5, KVT_IO_FOREGROUND, 10);
    kvt_io_ticket *t = NULL;
    assert_int_equal(kvt_io_submit(io, &op, &t), 0);
    assert_int_equal(kvt_io_run_here(t), 1);
    assert_int_equal(c.runs[1], 1);
    kvt_io_disposition d = KVT_IO_DISCARD;
    void *r = NULL;
    assert_int_equal(kvt_io_wait(t, 0, &d, &r), 0); /* done: no waiting */
    assert_int_equal(d, KVT_IO_PUBLISH);
    assert_int_equal(*(int *)r, 1001);
    assert_int_equal(kvt_io_run_here(t), 0);
    assert_int_equal(kvt_io_run_here(NULL), KVT_EINVAL);
    kvt_io_ticket_release(t);
    kvt_io_stats st;
    kvt_io_stats_get(io, &st);
    assert_int_equal(st.queued_ops, 0);
    assert_int_equal(st.running_ops, 1); /* the blocker */
    assert_int_equal(st.by_kind[KVT_IO_KIND_HASH].ran, 1);
    assert_int_equal(st.by_kind[KVT_IO_KIND_HASH].queued_ops, 0);
    gate_open(&g);
    kvt_io_ticket_release(blocker);
    kvt_io_destroy(io);
    assert_int_equal(c.freed_tasks, 2);
    gate_destroy(&g);
}

/* Two threads, background bound 1: a second background operation waits
 * while one runs, and a foreground one still starts on the other thread. */
static void test_background_bound(void **state)
{
    (void)state;
    counts c = {0};
    gate g, g2;
    gate_init(&g);
    gate_init(&g2);
    kvt_io_options o = {.threads = 2};
    kvt_io *io = NULL;
    assert_int_equal(kvt_io_create(&o, &io), 0);
    kvt_io_ticket *bg1 = block_thread(io, &c, &g, 0); /* background, gated */
    kvt_io_op op = make_op(&c, NULL, 1, KVT_IO_KIND_WRITE, 0xb2, KVT_IO_BACKGROUND, 10);
    kvt_io_ticket *bg2 = NULL;
    assert_int_equal(kvt_io_submit(io, &op, &bg2), 0);
    op = make_op(&c, &g2, 2, KVT_IO_KIND_RESTORE, 0xf1, KVT_IO_FOREGROUND, 10);
    kvt_io_ticket *fg = NULL;
    assert_int_equal(kvt_io_submit(io, &op, &fg), 0);
    gate_wait_entered(&g2, 1); /* the foreground one started on the free thread */
    gate_open(&g2);
    assert_int_equal(kvt_io_wait(fg, 10000, NULL, NULL), 0);
    usleep(20000);
    assert_int_equal(c.runs[1], 0); /* the second background one still waits */
    assert_int_equal(kvt_io_wait(bg2, 0, NULL, NULL), KVT_EAGAIN);
    gate_open(&g);
    assert_int_equal(kvt_io_wait(bg2, 10000, NULL, NULL), 0);
    assert_int_equal(c.runs[1], 1);
    kvt_io_ticket_release(bg1);
    kvt_io_ticket_release(bg2);
    kvt_io_ticket_release(fg);
    o.max_background = 3; /* more than threads */
    kvt_io *bad = NULL;
    assert_int_equal(kvt_io_create(&o, &bad), KVT_EINVAL);
    assert_null(bad);
    kvt_io_destroy(io);
    gate_destroy(&g);
    gate_destroy(&g2);
}

/* The default worker: shared while referenced, destroyed by the last
 * release, a new one after. */
static void test_default(void **state)
{
    (void)state;
    kvt_io *a = NULL, *b = NULL;
    assert_int_equal(kvt_io_default_acquire(&a), 0);
    assert_int_equal(kvt_io_default_acquire(&b), 0);
    assert_ptr_equal(a, b);
    counts c = {0};
    kvt_io_op op = make_op(&c, NULL, 1, KVT_IO_KIND_WRITE, 9, KVT_IO_BACKGROUND, 10);
    assert_int_equal(kvt_io_submit(a, &op, NULL), 0);
    kvt_io_default_release(a);
    kvt_io_default_release(b); /* flushes: the write ran */
    assert_int_equal(c.runs[1], 1);
    assert_int_equal(c.freed_tasks, 1);
    assert_int_equal(kvt_io_default_acquire(&a), 0);
    kvt_io_stats st;
    kvt_io_stats_get(a, &st);
    assert_int_equal(st.submitted, 0);
    kvt_io_default_release(a);
    kvt_io_default_release(NULL);
    assert_int_equal(kvt_io_default_acquire(NULL), KVT_EINVAL);
    assert_string_equal(kvt_io_kind_name(KVT_IO_KIND_REMOTE_SET), "remote-set");
    assert_string_equal(kvt_io_kind_name(KVT_IO_KIND_FIND), "find");
    assert_string_equal(kvt_io_kind_name(KVT_IO_KINDS), "unknown");
}

/* ---- a failed run reaches every waiter; bad arguments ---------------------- */

static void test_errors(void **state)
{
    (void)state;
    counts c = {0};
    kvt_io *io = NULL;
    kvt_io_options bad = {.threads = 65};
    assert_int_equal(kvt_io_create(&bad, &io), KVT_EINVAL);
    assert_null(io);
    io = new_io(1, 8, 1 << 20);
    kvt_io_op op = make_op(&c, NULL, 1, KVT_IO_KIND_RESTORE, 1, KVT_IO_FOREGROUND, 1);
    ((task *)op.task)->fail = KVT_EIO;
    kvt_io_ticket *t = NULL;
    assert_int_equal(kvt_io_submit(io, &op, &t), 0);
    kvt_io_disposition d = KVT_IO_PUBLISH;
    void *r = NULL;
    assert_int_equal(kvt_io_wait(t, UINT64_MAX, &d, &r), KVT_EIO);
    assert_int_equal(d, KVT_IO_DISCARD);
    assert_null(r);
    kvt_io_ticket_release(t);
    kvt_io_op none = op;
    none.run = NULL;
    assert_int_equal(kvt_io_submit(io, &none, &t), KVT_EINVAL);
    none = op;
    none.kind = KVT_IO_KINDS;
    assert_int_equal(kvt_io_submit(io, &none, &t), KVT_EINVAL);
    assert_null(t);
    kvt_io_stats st;
    kvt_io_stats_get(io, &st);
    assert_int_equal(st.failed, 1);
    kvt_io_cancel(NULL);
    kvt_io_ticket_release(NULL);
    kvt_io_destroy(io);
    kvt_io_destroy(NULL);
    assert_int_equal(c.freed_tasks, 1);

    /* destroy discards what nobody waits for and frees it */
    gate g;
    gate_init(&g);
    io = new_io(1, 8, 1 << 20);
    kvt_io_ticket *blocker = block_thread(io, &c, &g, 2);
    op = make_op(&c, NULL, 3, KVT_IO_KIND_WRITE, 99, KVT_IO_BACKGROUND, 1);
    assert_int_equal(kvt_io_submit(io, &op, NULL), 0);
    gate_open(&g);
    assert_int_equal(kvt_io_wait(blocker, UINT64_MAX, &d, &r), 0);
    kvt_io_ticket_release(blocker);
    kvt_io_destroy(io); /* op 3 ran or was discarded: freed either way */
    assert_int_equal(c.freed_tasks, 3);
    gate_destroy(&g);
}

/* ---- a failed run's message reaches every waiter, on every thread ---------- */

static char g_told_msg[256];

static void tell_msg(void *arg, int status, kvt_io_disposition d, void *result)
{
    (void)d;
    (void)result;
    *(int *)arg = status;
    snprintf(g_told_msg, sizeof g_told_msg, "%s", kvt_last_error());
}

/* A run on the worker's thread fails with a sentence: the ticket's waiter
 * (another thread) and a coalesced notify waiter both read that sentence
 * from kvt_last_error(), not only its code; a run that set no message gives
 * "the <kind> failed"; a later success's waiter is not told an old one. */
static void test_error_message(void **state)
{
    (void)state;
    counts c = {0};
    gate g;
    gate_init(&g);
    kvt_io *io = new_io(1, 8, 1 << 20);
    kvt_io_op op = make_op(&c, &g, 1, KVT_IO_KIND_RESTORE, 7, KVT_IO_FOREGROUND, 1);
    ((task *)op.task)->fail = KVT_EFORMAT;
    ((task *)op.task)->msg = "shard 3: checksum mismatch at byte 4242";
    kvt_io_ticket *t = NULL;
    assert_int_equal(kvt_io_submit(io, &op, &t), 0);
    gate_wait_entered(&g, 1); /* running on the worker's thread */
    int told_status = -1;
    kvt_io_op same = make_op(&c, NULL, 2, KVT_IO_KIND_RESTORE, 7, KVT_IO_FOREGROUND, 1);
    assert_int_equal(kvt_io_submit_notify(io, &same, tell_msg, &told_status), 0); /* coalesced */
    kvt__fail(KVT_EINVAL, "an older message of this thread");
    gate_open(&g);
    assert_int_equal(kvt_io_wait(t, UINT64_MAX, NULL, NULL), KVT_EFORMAT);
    assert_string_equal(kvt_last_error(), "shard 3: checksum mismatch at byte 4242 (task 1)");
    kvt_io_ticket_release(t);
    assert_int_equal(kvt_io_flush(io, 10000), 0);
    assert_int_equal(told_status, KVT_EFORMAT);
    assert_string_equal(g_told_msg, "shard 3: checksum mismatch at byte 4242 (task 1)");
    assert_int_equal(c.runs[1], 1);
    assert_int_equal(c.runs[2], 0);

    /* no message set by the run: the generic sentence, not a stale one */
    op = make_op(&c, NULL, 3, KVT_IO_KIND_WRITE, 8, KVT_IO_FOREGROUND, 1);
    ((task *)op.task)->fail = KVT_EIO;
    assert_int_equal(kvt_io_submit(io, &op, &t), 0);
    assert_int_equal(kvt_io_wait(t, UINT64_MAX, NULL, NULL), KVT_EIO);
    assert_non_null(strstr(kvt_last_error(), "kvt_io_wait: the write failed"));
    kvt_io_ticket_release(t);

    /* run here (the caller's thread), failing: its own message, kept */
    gate g2;
    gate_init(&g2);
    kvt_io_ticket *blocker = block_thread(io, &c, &g2, 4);
    op = make_op(&c, NULL, 5, KVT_IO_KIND_HASH, 9, KVT_IO_FOREGROUND, 1);
    ((task *)op.task)->fail = KVT_ENOMEM;
    ((task *)op.task)->msg = "no room";
    assert_int_equal(kvt_io_submit(io, &op, &t), 0);
    assert_int_equal(kvt_io_run_here(t), 1);
    kvt__clear_error();
    assert_int_equal(kvt_io_wait(t, 0, NULL, NULL), KVT_ENOMEM);
    assert_string_equal(kvt_last_error(), "no room (task 5)");
    kvt_io_ticket_release(t);
    gate_open(&g2);
    kvt_io_ticket_release(blocker);
    kvt_io_destroy(io);
    assert_int_equal(c.freed_tasks, 5);
    gate_destroy(&g);
    gate_destroy(&g2);
}

/* ---- randomized: several threads submit, wait, cancel, release ------------------ */

typedef struct mix {
    kvt_io *io;
    counts *c;
    uint64_t seed;
    int created;  /* atomic: tasks made */
    int bad;      /* atomic: unexpected outcomes */
} mix;

typedef struct mix_arg {
    mix *m;
    int id;
} mix_arg;

static uint64_t next_rand(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void *mix_thread(void *arg)
{
    mix_arg *a = arg;
    mix *m = a->m;
    uint64_t s = m->seed + 0x9e3779b97f4a7c15ull * (uint64_t)(a->id + 1);
    for (int i = 0; i < 400; i++) {
        uint64_t x = next_rand(&s);
        int key = (int)(x % 8);
        kvt_io_op op = make_op(m->c, NULL, 10 + key, (kvt_io_kind)((x >> 8) % 2), (uint64_t)key,
                               (kvt_io_priority)((x >> 12) % 2), 64);
        __atomic_fetch_add(&m->created, 1, __ATOMIC_SEQ_CST);
        int with_ticket = (x >> 16) % 4 != 0;
        kvt_io_ticket *t = NULL;
        int rc = kvt_io_submit(m->io, &op, with_ticket ? &t : NULL);
        if (rc == KVT_EAGAIN) {
            task_free(op.task, NULL);
            continue;
        }
        if (rc) {
            __atomic_fetch_add(&m->bad, 1, __ATOMIC_SEQ_CST);
            task_free(op.task, NULL);
            continue;
        }
        if (!t)
            continue;
        int act = (int)((x >> 20) % 3);
        kvt_io_disposition d;
        void *r;
        if (act == 0) {
            rc = kvt_io_wait(t, UINT64_MAX, &d, &r);
            if (rc != 0 || d != KVT_IO_PUBLISH || *(int *)r != 1010 + key)
                __atomic_fetch_add(&m->bad, 1, __ATOMIC_SEQ_CST);
        } else if (act == 1) {
            kvt_io_cancel(t);
            if (kvt_io_wait(t, 0, &d, &r) == 0 && d != KVT_IO_PUBLISH)
                __atomic_fetch_add(&m->bad, 1, __ATOMIC_SEQ_CST);
        }
        kvt_io_ticket_release(t);
    }
    return NULL;
}

static void test_random_mix(void **state)
{
    (void)state;
    counts c = {0};
    mix m = {.io = new_io(3, 16, 512), .c = &c, .seed = test_seed("test_io random mix")};
    pthread_t th[6];
    mix_arg args[6];
    for (int i = 0; i < 6; i++) {
        args[i] = (mix_arg){&m, i};
        assert_int_equal(pthread_create(&th[i], NULL, mix_thread, &args[i]), 0);
    }
    for (int i = 0; i < 6; i++)
        pthread_join(th[i], NULL);
    assert_int_equal(kvt_io_flush(m.io, 30000), 0);
    kvt_io_stats st;
    kvt_io_stats_get(m.io, &st);
    printf("random mix: %llu submitted, %llu coalesced, %llu refused, %llu ran, %llu discarded, "
           "%llu results discarded\n",
           (unsigned long long)st.submitted, (unsigned long long)st.coalesced, (unsigned long long)st.refused,
           (unsigned long long)st.ran, (unsigned long long)st.discarded, (unsigned long long)st.results_discarded);
    kvt_io_destroy(m.io);
    assert_int_equal(m.bad, 0);
    assert_int_equal(c.freed_tasks, m.created); /* every task freed exactly once */
    assert_int_equal(st.submitted + st.refused, (uint64_t)m.created);
    assert_int_equal(st.ran + st.discarded, st.submitted - st.coalesced);
    assert_int_equal(st.queued_ops + st.running_ops + st.queued_bytes, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sixteen_one_read), cmocka_unit_test(test_cancel_all),
        cmocka_unit_test(test_full_queue),       cmocka_unit_test(test_priority_order),
        cmocka_unit_test(test_errors),           cmocka_unit_test(test_random_mix),
        cmocka_unit_test(test_error_message),
        cmocka_unit_test(test_notify),           cmocka_unit_test(test_run_here),
        cmocka_unit_test(test_background_bound), cmocka_unit_test(test_default),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
