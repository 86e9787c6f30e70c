/* st_units: the units of a job made from a safetensors file, for a restore
 * into a job that has none (ckpt.h; docs/bases.md, "A base from a
 * safetensors file"). A safetensors file has tensors and no units, so the
 * units are made as zerod.torch's per-module plan makes them: one unit per
 * module, the module being a tensor's name up to its last '.'
 * ("blocks.0.up.weight" is module "blocks.0.up"'s), "<root>" for names
 * without one. Units come in the order of their modules' names, their
 * tensors by name; a worker that refers to them from a base matches
 * tensors by name (rank/base_units.c), so the order within a unit is the
 * file's business. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_job.h"

#define ROOT_UNIT "<root>"

/* The length of name's module part (0: the root's). */
static size_t module_length(const char *name) {
  const char *dot = strrchr(name, '.');
  return dot != NULL ? (size_t)(dot - name) : 0;
}

/* Whether tensors a and b belong to one module. */
static int same_module(const st_tensor *a, const st_tensor *b) {
  size_t la = module_length(a->name), lb = module_length(b->name);
  return la == lb && strncmp(a->name, b->name, la) == 0;
}

/* Orders tensors by module, then by name (qsort of st_tensor pointers). */
static int by_module(const void *pa, const void *pb) {
  const st_tensor *a = *(const st_tensor *const *)pa, *b = *(const st_tensor *const *)pb;
  size_t la = module_length(a->name), lb = module_length(b->name);
  int c = strncmp(a->name, b->name, la < lb ? la : lb);
  if (c != 0)
    return c;
  if (la != lb)
    return la < lb ? -1 : 1;
  return strcmp(a->name, b->name);
}

/* Builds the unit of tensors[0..n) (one module), named from the first. */
static int build_unit(const st_tensor *const *tensors, unsigned n, int world_size,
                      unit_layout **out, char *err, size_t err_bytes) {
  char unit[1024];
  const char *first = tensors[0]->name;
  size_t len = module_length(first);
  snprintf(unit, sizeof unit, "%.*s", (int)(len > 0 ? len : sizeof ROOT_UNIT - 1),
           len > 0 ? first : ROOT_UNIT);
  tensor_specs specs;
  int rc = tensor_specs_init(&specs, n);
  if (rc == 0) {
    for (unsigned t = 0; t < n; t++) {
      specs.names[t] = tensors[t]->name;
      specs.shapes[t] = tensors[t]->shape;
      specs.ndims[t] = tensors[t]->ndim;
    }
    rc = unit_layout_build_specs(unit, &specs, world_size, 0, out, err, err_bytes);
    tensor_specs_free(&specs);
  }
  if (rc == -ENOMEM)
    snprintf(err, err_bytes, "out of memory");
  return rc;
}

int st_units_build(const st_file *f, int world_size, unit_layout ***out, unsigned *nout, char *err,
                   size_t err_bytes) {
  *out = NULL;
  *nout = 0;
  if (f->ntensors == 0) {
    snprintf(err, err_bytes, "the file holds no tensor");
    return -EINVAL;
  }
  const st_tensor **order = calloc(f->ntensors, sizeof *order);
  unit_layout **units = calloc(f->ntensors, sizeof *units);
  if (order == NULL || units == NULL) {
    free(order);
    free(units);
    snprintf(err, err_bytes, "out of memory");
    return -ENOMEM;
  }
  for (unsigned i = 0; i < f->ntensors; i++)
    order[i] = &f->tensors[i];
  /* Sorted by name, a module's tensors may lie apart (a submodule's sort
   * between them); by module, they are together. */
  qsort(order, f->ntensors, sizeof *order, by_module);
  unsigned nunits = 0;
  int rc = 0;
  for (unsigned i = 0; i < f->ntensors && rc == 0;) {
    unsigned n = 1;
    while (i + n < f->ntensors && same_module(order[i], order[i + n]))
      n++;
    rc = build_unit(&order[i], n, world_size, &units[nunits], err, err_bytes);
    if (rc == 0)
      nunits++;
    i += n;
  }
  free(order);
  if (rc != 0) {
    for (unsigned u = 0; u < nunits; u++)
      unit_layout_free(units[u]);
    free(units);
    return rc;
  }
  *out = units;
  *nout = nunits;
  return 0;
}
