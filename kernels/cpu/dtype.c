/* dtype.c - names and sizes of the element types. */
#include "../zk.h"

size_t zk_dtype_size(zk_dtype dtype) {
  switch (dtype) {
  case ZK_F32:
    return 4;
  case ZK_BF16:
  case ZK_F16:
    return 2;
  default:
    return 0;
  }
}

const char *zk_dtype_name(zk_dtype dtype) {
  switch (dtype) {
  case ZK_F32:
    return "f32";
  case ZK_BF16:
    return "bf16";
  case ZK_F16:
    return "f16";
  case ZK_DTYPE_NONE:
    return "none";
  default:
    return "invalid";
  }
}
