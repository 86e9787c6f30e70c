/* ckpt_pool: the checkpoint files' work on libuv's thread pool
 * (coord_ckpt.h). File work that may take long on a big or remote
 * filesystem (a save's commit, a restore's checks, List's scan, an
 * export, every recursive removal) runs there, each piece with its own
 * copy of what it needs, and reports back to the loop. The pool counts
 * the pieces in flight (coord.ckpt.work), which must be none when the
 * coordinator is freed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord_ckpt.h"
#include "log.h"

static void work_run(uv_work_t *req) {
  ckpt_work *w = (ckpt_work *)req;
  w->run(w);
}

static void work_done(uv_work_t *req, int status) {
  ckpt_work *w = (ckpt_work *)req;
  w->c->ckpt.work--;
  w->done(w);
}

void coord__ckpt_queue_work(coord *c, ckpt_work *w) {
  w->c = c;
  c->ckpt.work++;
  if (uv_queue_work(c->loop, &w->req, work_run, work_done) != 0) {
    /* Only for a NULL callback, which never happens; do it in line then. */
    w->run(w);
    work_done(&w->req, 0);
  }
}

typedef struct remove_work {
  ckpt_work base;
  int rc;
  char why[32];
  char path[PATH_MAX];
} remove_work;

static void remove_run(ckpt_work *base) {
  remove_work *w = (remove_work *)base;
  w->rc = coord__ckpt_rmtree(w->path);
}

static void remove_done(ckpt_work *base) {
  remove_work *w = (remove_work *)base;
  if (w->rc != 0)
    LOG_WARNF("cannot remove a checkpoint directory; the next start removes it",
              "path=%s why=\"%s\" err=\"%s\"", w->path, w->why, strerror(-w->rc));
  else
    LOG_DEBUGF("removed a checkpoint directory", "path=%s why=\"%s\"", w->path, w->why);
  if (w->rc == 0)
    w->base.c->hooks.ckpt_removed(w->base.c, w->path);
  free(w);
}

/* Removes path recursively on the thread pool. If it cannot be (no
 * memory), the directory stays; its name marks it for removal at the next
 * start. */
static void queue_remove(coord *c, const char *path, const char *why) {
  remove_work *w = calloc(1, sizeof *w);
  if (w == NULL) {
    LOG_WARNF("cannot remove a checkpoint directory now; the next start removes it",
              "path=%s why=\"%s\" err=\"out of memory\"", path, why);
    return;
  }
  w->base.run = remove_run;
  w->base.done = remove_done;
  snprintf(w->why, sizeof w->why, "%s", why);
  snprintf(w->path, sizeof w->path, "%s", path);
  coord__ckpt_queue_work(c, &w->base);
}

void coord__ckpt_remove_tree(coord *c, const char *path, const char *why) {
  queue_remove(c, path, why);
}
