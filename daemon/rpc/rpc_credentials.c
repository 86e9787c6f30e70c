/* rpc_credentials: gRPC credentials made from rpc_tls (tls.h): the
 * server's (a certificate and its key, a CA to verify clients with) and a
 * channel's (rpc_impl.h). The PEM files are read by tls.c. */
#include "rpc_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include <grpc/grpc_security.h>

#include "tls.h"
#include "tls_reload.h"

static int tls_set(const char *s) {
  return s != NULL && s[0] != '\0';
}

int rpc__server_credentials(const rpc_tls *tls, grpc_server_credentials **out, tls_reload **reload,
                            char *err, size_t err_bytes) {
  *out = NULL;
  *reload = NULL;
  if (!tls_set(tls->cert_file) || !tls_set(tls->key_file)) {
    snprintf(err, err_bytes, "TLS needs both a certificate and its key");
    return -EINVAL;
  }
  if (tls->require_client_cert && !tls_set(tls->ca_file)) {
    snprintf(err, err_bytes, "mutual TLS needs the CA that signs client certificates");
    return -EINVAL;
  }
  /* Read now, so that bad files fail the start with their reason; read
   * again at a handshake after they change (tls_reload.h). */
  int rc = tls_reload_create(tls, reload, err, err_bytes);
  if (rc != 0)
    return rc;
  grpc_ssl_client_certificate_request_type request =
      !tls_set(tls->ca_file)     ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
      : tls->require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                 : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
  grpc_ssl_server_credentials_options *options =
      grpc_ssl_server_credentials_create_options_using_config_fetcher(request, tls_reload_fetch,
                                                                      *reload);
  *out = options != NULL ? grpc_ssl_server_credentials_create_with_options(options) : NULL;
  if (*out == NULL) {
    snprintf(err, err_bytes, "gRPC refused the TLS material (%s, %s)", tls->cert_file,
             tls->key_file);
    tls_reload_free(*reload);
    *reload = NULL;
    return -EINVAL;
  }
  return 0;
}

/* A client with a certificate of its own (a node under mutual TLS): gRPC's
 * file watcher reads the key, the certificate and the CA again every
 * RPC_TLS_REFRESH_S seconds, so a renewed certificate (cert-manager's, the
 * kubelet swapping the Secret's files) is what the next connection
 * presents, without a restart. The files were read once by the caller to
 * report a missing or malformed one clearly; the watcher keeps the last
 * good material when a later read fails. Without a CA file the system's
 * roots are used, as grpc_ssl_credentials_create does. */
static grpc_channel_credentials *watched_credentials(const rpc_tls *tls) {
  grpc_tls_certificate_provider *provider = grpc_tls_certificate_provider_file_watcher_create(
      tls->key_file, tls->cert_file, tls_set(tls->ca_file) ? tls->ca_file : NULL,
      RPC_TLS_REFRESH_S);
  if (provider == NULL)
    return NULL;
  grpc_tls_credentials_options *options = grpc_tls_credentials_options_create();
  grpc_tls_credentials_options_set_certificate_provider(options, provider);
  grpc_tls_certificate_provider_release(provider); /* the options hold a reference */
  if (tls_set(tls->ca_file))
    grpc_tls_credentials_options_watch_root_certs(options);
  grpc_tls_credentials_options_watch_identity_key_cert_pairs(options);
  grpc_tls_credentials_options_set_verify_server_cert(options, 1);
  return grpc_tls_credentials_create(options); /* takes the options */
}

int rpc__channel_credentials(const rpc_tls *tls, grpc_channel_credentials **out, char *err,
                             size_t err_bytes) {
  *out = NULL;
  if (tls_set(tls->cert_file) != tls_set(tls->key_file)) {
    snprintf(err, err_bytes, "a client certificate needs its key, and a key its certificate");
    return -EINVAL;
  }
  char *cert = NULL, *key = NULL, *ca = NULL;
  int rc = 0;
  if (tls_set(tls->ca_file))
    rc = tls_read_pem(tls->ca_file, "CA certificate", &ca, err, err_bytes);
  if (rc == 0 && tls_set(tls->cert_file))
    rc = tls_read_pem(tls->cert_file, "certificate", &cert, err, err_bytes);
  if (rc == 0 && tls_set(tls->key_file))
    rc = tls_read_pem(tls->key_file, "private key", &key, err, err_bytes);
  if (rc == 0 && cert != NULL) {
    *out = watched_credentials(tls);
  } else if (rc == 0) {
    *out = grpc_ssl_credentials_create(ca, NULL, NULL, NULL);
  }
  if (rc == 0) {
    if (*out == NULL) {
      snprintf(err, err_bytes, "gRPC refused the TLS material");
      rc = -EINVAL;
    }
  }
  free(cert);
  free(key);
  free(ca);
  return rc;
}
