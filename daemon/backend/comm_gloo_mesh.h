/* comm_gloo_mesh.h - a Gloo communicator's rendezvous and connections
 * (C++ only; comm_gloo.cc is its one user). */
#ifndef ZEROD_BACKEND_COMM_GLOO_MESH_H
#define ZEROD_BACKEND_COMM_GLOO_MESH_H

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>

#include <gloo/transport/context.h>
#include <gloo/transport/device.h>

#include "comm_cancel.h"
#include "comm_impl.h"
extern "C" {
#include "store.h"
}

namespace zerod_gloo {

/* Thrown by a store wait or write that failed; carries the errno and the
 * key so that the rendezvous can say which rank never showed up. */
struct StoreFailure : std::runtime_error {
  StoreFailure(int store_error, const std::string &store_key, const std::string &what)
      : std::runtime_error(what), error(store_error), key(store_key) {}
  int error;
  std::string key;
};

/* Thrown once the creation's comm_cancel has fired. */
struct Cancelled : std::runtime_error {
  Cancelled() : std::runtime_error("cancelled") {}
};

/* Unhooks a comm_cancel when it goes out of scope, before what its hook
 * touches does. */
struct CancelHook {
  explicit CancelHook(comm_cancel *cancel) : cancel_(cancel) {}
  ~CancelHook() {
    comm_cancel_unhook(cancel_);
  }
  CancelHook(const CancelHook &) = delete;
  CancelHook &operator=(const CancelHook &) = delete;

private:
  comm_cancel *cancel_;
};

/* A transport context of dev whose pair to every other rank is connected,
 * through the addresses the ranks exchange in st under "<prefix>/<rank>".
 * Each pair's connect waits up to pair_timeout, every store wait until
 * deadline; options->cancel cuts either short. Throws StoreFailure,
 * Cancelled, or what Gloo throws. */
std::shared_ptr<gloo::transport::Context>
connect_pairs(const std::shared_ptr<gloo::transport::Device> &dev, const comm_options *options,
              store *st, std::chrono::milliseconds pair_timeout,
              std::chrono::steady_clock::time_point deadline);

/* The rank whose rendezvous key ("<rank>") key is; -1 for any other key. */
int rank_of_store_key(const std::string &key);

} // namespace zerod_gloo

#endif /* ZEROD_BACKEND_COMM_GLOO_MESH_H */
