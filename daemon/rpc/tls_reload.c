/* tls_reload.c - a TLS server's files, read again when they change
 * (tls_reload.h). */
#include "tls_reload.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <openssl/bio.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "log.h"

#define NFILES 3 /* certificate, key, client CA (optional) */

typedef struct stamp {
  dev_t dev;
  ino_t ino;
  off_t size;
  struct timespec mtime;
  int present;
} stamp;

struct tls_reload {
  pthread_mutex_t mutex;
  char paths[NFILES][PATH_MAX]; /* "" for a file not used */
  stamp stamps[NFILES];
  int fetched; /* gRPC has had a config */
  unsigned long reloads;
  char *pem[NFILES]; /* the material in use */
};

static void stamp_of(const char *path, stamp *out) {
  struct stat st;
  memset(out, 0, sizeof *out);
  if (path[0] == '\0' || stat(path, &st) != 0)
    return;
  *out = (stamp){
      .dev = st.st_dev, .ino = st.st_ino, .size = st.st_size, .mtime = st.st_mtim, .present = 1};
}

static int stamp_equal(const stamp *a, const stamp *b) {
  return a->present == b->present && a->dev == b->dev && a->ino == b->ino && a->size == b->size &&
         a->mtime.tv_sec == b->mtime.tv_sec && a->mtime.tv_nsec == b->mtime.tv_nsec;
}

/* Whether the PEM key is the PEM certificate's (its public key). */
static int key_matches(const char *cert_pem, const char *key_pem) {
  BIO *cb = BIO_new_mem_buf(cert_pem, -1), *kb = BIO_new_mem_buf(key_pem, -1);
  X509 *cert = cb != NULL ? PEM_read_bio_X509(cb, NULL, NULL, NULL) : NULL;
  EVP_PKEY *key = kb != NULL ? PEM_read_bio_PrivateKey(kb, NULL, NULL, NULL) : NULL;
  int ok = cert != NULL && key != NULL && X509_check_private_key(cert, key) == 1;
  X509_free(cert);
  EVP_PKEY_free(key);
  BIO_free(cb);
  BIO_free(kb);
  return ok;
}

/* Reads every file into pem[]; 0, or an error in err (pem[] freed). */
static int read_all(const tls_reload *r, char *pem[NFILES], char *err, size_t err_bytes) {
  static const char *const what[NFILES] = {"certificate", "private key", "client CA"};
  memset(pem, 0, NFILES * sizeof *pem);
  int rc = 0;
  for (int i = 0; i < NFILES && rc == 0; i++)
    if (r->paths[i][0] != '\0')
      rc = tls_read_pem(r->paths[i], what[i], &pem[i], err, err_bytes);
  if (rc == 0 && !key_matches(pem[0], pem[1])) {
    snprintf(err, err_bytes, "the private key %s is not the certificate %s's", r->paths[1],
             r->paths[0]);
    rc = -EINVAL;
  }
  if (rc != 0)
    for (int i = 0; i < NFILES; i++) {
      free(pem[i]);
      pem[i] = NULL;
    }
  return rc;
}

static void take(tls_reload *r, char *pem[NFILES]) {
  for (int i = 0; i < NFILES; i++) {
    free(r->pem[i]);
    r->pem[i] = pem[i];
  }
}

int tls_reload_create(const rpc_tls *tls, tls_reload **out, char *err, size_t err_bytes) {
  *out = NULL;
  tls_reload *r = calloc(1, sizeof *r);
  if (r == NULL)
    return -ENOMEM;
  const char *files[NFILES] = {tls->cert_file, tls->key_file, tls->ca_file};
  for (int i = 0; i < NFILES; i++) {
    snprintf(r->paths[i], sizeof r->paths[i], "%s", files[i] != NULL ? files[i] : "");
    stamp_of(r->paths[i], &r->stamps[i]);
  }
  char *pem[NFILES];
  int rc = read_all(r, pem, err, err_bytes);
  if (rc != 0) {
    free(r);
    return rc;
  }
  take(r, pem);
  pthread_mutex_init(&r->mutex, NULL);
  *out = r;
  return 0;
}

void tls_reload_free(tls_reload *r) {
  if (r == NULL)
    return;
  char *none[NFILES] = {NULL, NULL, NULL};
  take(r, none);
  pthread_mutex_destroy(&r->mutex);
  free(r);
}

/* Whether a file changed since its stamp; the new stamps into now. */
static int changed(const tls_reload *r, stamp now[NFILES]) {
  int any = 0;
  for (int i = 0; i < NFILES; i++) {
    stamp_of(r->paths[i], &now[i]);
    any |= !stamp_equal(&now[i], &r->stamps[i]);
  }
  return any;
}

static grpc_ssl_server_certificate_config *config_of(const tls_reload *r) {
  grpc_ssl_pem_key_cert_pair pair = {.private_key = r->pem[1], .cert_chain = r->pem[0]};
  /* gRPC's fetcher path asserts root certificates even when no client
   * certificate is requested (ssl_security_connector.cc): without a client
   * CA, the server's own chain stands in, never used to verify anyone. */
  const char *roots = r->pem[2] != NULL ? r->pem[2] : r->pem[0];
  return grpc_ssl_server_certificate_config_create(roots, &pair, 1);
}

grpc_ssl_certificate_config_reload_status
tls_reload_fetch(void *arg, grpc_ssl_server_certificate_config **config) {
  tls_reload *r = arg;
  grpc_ssl_certificate_config_reload_status status = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_UNCHANGED;
  pthread_mutex_lock(&r->mutex);
  stamp now[NFILES];
  if (changed(r, now)) {
    char *pem[NFILES], err[512] = "";
    memcpy(r->stamps, now, sizeof r->stamps); /* warn once per change */
    if (read_all(r, pem, err, sizeof err) == 0) {
      take(r, pem);
      r->reloads++;
      r->fetched = 0;
      LOG_INFOF("TLS certificate reloaded", "cert=%s reloads=%lu", r->paths[0], r->reloads);
    } else {
      LOG_WARNF("TLS files changed but were not taken; the previous stay", "cert=%s error=\"%s\"",
                r->paths[0], err);
    }
  }
  if (!r->fetched) {
    *config = config_of(r);
    if (*config != NULL) {
      r->fetched = 1;
      status = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_NEW;
    } else {
      status = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_FAIL;
    }
  }
  pthread_mutex_unlock(&r->mutex);
  return status;
}
