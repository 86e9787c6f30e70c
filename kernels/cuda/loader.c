/* loader.c - finds, opens and checks the CUDA kernel module.
 *
 * Part of the CPU kernel library: plain C that needs nothing from CUDA to
 * build or run. zk_cuda_load does its work once per process (pthread_once)
 * and caches the outcome, the table or the reason there is none, so every
 * caller on every thread gets the same answer cheaply.
 *
 * Where the module is looked for, first match wins:
 * 1. $ZEROD_CUDA_MODULE, when set: the one place looked at, so that a
 *    wrong setting is reported rather than silently replaced;
 * 2. next to the library or program that contains this loader (an installed
 *    libzerod.so and its module sit in one directory, the install's libdir);
 * 3. in the install's libdir as seen from that directory
 *    (ZK_CUDA_MODULE_REL_DIR, set by kernels/CMakeLists.txt to the path
 *    from bindir to libdir, e.g. ../lib): an installed zerod, which links
 *    this loader statically, finds the module installed with it wherever
 *    the tree was installed (cmake --install --prefix, DESTDIR) or moved;
 * 4. the build tree that this loader was compiled in
 *    (ZK_CUDA_MODULE_BUILD_DIR, set by kernels/CMakeLists.txt), so tests and
 *    benchmarks find a freshly built module without any setup;
 * 5. the dynamic linker's search path (LD_LIBRARY_PATH, ld.so.cache).
 */
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "zk_cuda.h"

#ifndef ZK_CUDA_MODULE_BUILD_DIR
#define ZK_CUDA_MODULE_BUILD_DIR ""
#endif
#ifndef ZK_CUDA_MODULE_REL_DIR
#define ZK_CUDA_MODULE_REL_DIR ""
#endif

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static const zk_cuda_api *loaded_api;
static int load_status;
static char load_why[512];

/* Records why loading failed (or, on success, what was loaded); a long
 * path is cut rather than overflowing. */
__attribute__((format(printf, 1, 2))) static void set_why(const char *fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(load_why, sizeof load_why, fmt, args);
  va_end(args);
}

/* dlerror() after a failed dlopen or dlsym, never NULL. */
static const char *dl_reason(void) {
  const char *reason = dlerror();
  return reason != NULL ? reason : "unknown dynamic loader error";
}

/* Opens path if the file exists; *missing tells "not there" apart from
 * "there but unloadable", which is worth reporting. */
static void *open_module_at(const char *path, int *missing) {
  if (access(path, F_OK) != 0) {
    *missing = 1;
    return NULL;
  }
  *missing = 0;
  return dlopen(path, RTLD_NOW | RTLD_LOCAL);
}

/* The directory of the object (shared library or executable) that contains
 * this function, with a trailing '/', or 0 if unknown. */
static int own_directory(char *dir, size_t dir_len) {
  Dl_info info;
  if (dladdr((void *)own_directory, &info) == 0 || info.dli_fname == NULL)
    return 0;
  const char *slash = strrchr(info.dli_fname, '/');
  if (slash == NULL)
    return 0;
  size_t len = (size_t)(slash - info.dli_fname) + 1;
  if (len >= dir_len)
    return 0;
  memcpy(dir, info.dli_fname, len);
  dir[len] = '\0';
  return 1;
}

/* Finds and opens the module; on success *path_out says where it was found. */
static void *open_module(char *path_out, size_t path_len) {
  const char *env_path = secure_getenv("ZEROD_CUDA_MODULE");
  int missing;
  void *handle;

  if (env_path != NULL && env_path[0] != '\0') {
    snprintf(path_out, path_len, "%s", env_path);
    handle = open_module_at(env_path, &missing);
    if (handle == NULL)
      set_why("ZEROD_CUDA_MODULE=%s: %s", env_path, missing ? strerror(ENOENT) : dl_reason());
    return handle;
  }

  char dir[PATH_MAX];
  if (own_directory(dir, sizeof dir)) {
    snprintf(path_out, path_len, "%s%s", dir, ZK_CUDA_MODULE_NAME);
    handle = open_module_at(path_out, &missing);
    if (handle != NULL || !missing) {
      if (handle == NULL)
        set_why("%s: %s", path_out, dl_reason());
      return handle;
    }
    if (ZK_CUDA_MODULE_REL_DIR[0] != '\0') {
      snprintf(path_out, path_len, "%s%s/%s", dir, ZK_CUDA_MODULE_REL_DIR, ZK_CUDA_MODULE_NAME);
      handle = open_module_at(path_out, &missing);
      if (handle != NULL || !missing) {
        if (handle == NULL)
          set_why("%s: %s", path_out, dl_reason());
        return handle;
      }
    }
  }

  if (ZK_CUDA_MODULE_BUILD_DIR[0] != '\0') {
    snprintf(path_out, path_len, "%s/%s", ZK_CUDA_MODULE_BUILD_DIR, ZK_CUDA_MODULE_NAME);
    handle = open_module_at(path_out, &missing);
    if (handle != NULL || !missing) {
      if (handle == NULL)
        set_why("%s: %s", path_out, dl_reason());
      return handle;
    }
  }

  snprintf(path_out, path_len, "%s", ZK_CUDA_MODULE_NAME);
  handle = dlopen(ZK_CUDA_MODULE_NAME, RTLD_NOW | RTLD_LOCAL);
  if (handle == NULL)
    set_why("no CUDA module: %s is neither in %s nor on the library search path (%s); "
            "build with -DZEROD_CUDA=ON or set ZEROD_CUDA_MODULE",
            ZK_CUDA_MODULE_NAME,
            ZK_CUDA_MODULE_BUILD_DIR[0] != '\0' ? ZK_CUDA_MODULE_BUILD_DIR : "a build tree",
            dl_reason());
  return handle;
}

static void load_module(void) {
  char path[PATH_MAX + 64];
  void *handle = open_module(path, sizeof path);
  if (handle == NULL) {
    load_status = -ENOENT;
    return;
  }

  /* POSIX's way of turning a data pointer into a function pointer. */
  zk_cuda_get_api_fn get_api;
  *(void **)&get_api = dlsym(handle, "zk_cuda_get_api");
  if (get_api == NULL) {
    set_why("%s: no zk_cuda_get_api: %s", path, dl_reason());
    dlclose(handle);
    load_status = -EPROTO;
    return;
  }
  const zk_cuda_api *api = get_api(ZK_CUDA_API_VERSION);
  /* The table only grows at its end: a larger one from a newer module is
   * fine, a smaller one lacks entries this library calls. */
  if (api == NULL || api->size < sizeof(zk_cuda_api) || api->version < ZK_CUDA_API_VERSION) {
    set_why("%s: cannot serve API version %d (module: version %d, table %zu bytes, need %zu)", path,
            ZK_CUDA_API_VERSION, api != NULL ? api->version : -1,
            api != NULL ? api->size : (size_t)0, sizeof(zk_cuda_api));
    dlclose(handle);
    load_status = -EPROTO;
    return;
  }

  /* From here on the CUDA runtime inside the module is initialised (driver
   * state, possibly threads of its own), and unloading it under its feet is
   * not safe: the module stays loaded even when no device is usable. */
  int count = 0;
  /* The reasons name the module too: which copy was loaded is what tells
   * an installed program's module apart from a build tree's. */
  int rc = api->device_count(&count);
  if (rc != 0) {
    set_why("%s: %s", path, api->last_error());
    load_status = -ENODEV;
    return;
  }
  if (count <= 0) {
    set_why("%s: the CUDA runtime reports no device", path);
    load_status = -ENODEV;
    return;
  }

  char name[256] = "";
  if (api->device_name(0, name, sizeof name) != 0)
    snprintf(name, sizeof name, "device 0");
  set_why("%s: %d device(s), first %s", path, count, name);
  loaded_api = api;
  load_status = 0;
}

int zk_cuda_load(const zk_cuda_api **api_out, char *why, size_t why_len) {
  pthread_once(&load_once, load_module);
  if (why != NULL && why_len > 0)
    snprintf(why, why_len, "%s", load_why);
  if (api_out != NULL)
    *api_out = load_status == 0 ? loaded_api : NULL;
  return load_status;
}
