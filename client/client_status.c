/* libzerod: the one mapping between the protocol's Status codes (the wire,
 * proto/zerod/v1/ipc.proto) and zd_status (the API, zerod.h), and the
 * names zd_strerror gives them.
 *
 * Every status a call returns comes from this table: a daemon's Error or
 * Notice is translated here, and the library's own checks use the status
 * the daemon would have answered for the same fault (an unknown unit is
 * ZD_E_NOT_FOUND whether the library or the daemon notices it), so a
 * worker sees one status per fault. ZD_E_NOMEM and ZD_E_IO have no wire
 * code: only the library returns them. */
#include "client_impl.h"

typedef struct status_entry {
  int wire; /* a Zerod__V1__Status, or -1 for a status of the library alone */
  zd_status status;
  const char *name; /* zd_strerror's */
} status_entry;

static const status_entry status_table[] = {
    {ZEROD__V1__STATUS__STATUS_OK, ZD_OK, "OK"},
    {ZEROD__V1__STATUS__STATUS_INVALID_ARGUMENT, ZD_E_INVALID_ARGUMENT, "invalid argument"},
    {ZEROD__V1__STATUS__STATUS_NOT_FOUND, ZD_E_NOT_FOUND, "not found"},
    {ZEROD__V1__STATUS__STATUS_ALREADY_EXISTS, ZD_E_ALREADY_EXISTS, "already exists"},
    {ZEROD__V1__STATUS__STATUS_FAILED_PRECONDITION, ZD_E_FAILED_PRECONDITION,
     "failed precondition"},
    {ZEROD__V1__STATUS__STATUS_RESOURCE_EXHAUSTED, ZD_E_RESOURCE_EXHAUSTED, "resource exhausted"},
    {ZEROD__V1__STATUS__STATUS_PERMISSION_DENIED, ZD_E_PERMISSION_DENIED, "permission denied"},
    {ZEROD__V1__STATUS__STATUS_UNAVAILABLE, ZD_E_UNAVAILABLE, "unavailable"},
    {ZEROD__V1__STATUS__STATUS_INTERNAL, ZD_E_INTERNAL, "internal error"},
    {ZEROD__V1__STATUS__STATUS_ABORTED, ZD_E_ABORTED, "aborted"},
    {ZEROD__V1__STATUS__STATUS_PROTOCOL, ZD_E_PROTOCOL, "protocol error"},
    {-1, ZD_E_NOMEM, "out of memory"},
    {-1, ZD_E_IO, "I/O error"},
};

#define STATUS_TABLE_SIZE (sizeof status_table / sizeof status_table[0])

/* The zd_status of a wire Status in an Error or a Notice. OK there (a
 * daemon bug: an error without a status) and codes this library does not
 * know (a newer daemon's) are ZD_E_INTERNAL, so that a worker only ever
 * sees the codes zerod.h documents. */
zd_status client__status_from_wire(int wire_status) {
  for (size_t i = 0; i < STATUS_TABLE_SIZE; i++) {
    if (status_table[i].wire == wire_status && wire_status != ZEROD__V1__STATUS__STATUS_OK)
      return status_table[i].status;
  }
  return ZD_E_INTERNAL;
}

/* The wire Status of a zd_status, or -1 for those of the library alone
 * (and for codes that are not zd_status values). */
int client__status_to_wire(zd_status status) {
  for (size_t i = 0; i < STATUS_TABLE_SIZE; i++) {
    if (status_table[i].status == status)
      return status_table[i].wire;
  }
  return -1;
}

const char *zd_strerror(zd_status status) {
  for (size_t i = 0; i < STATUS_TABLE_SIZE; i++) {
    if (status_table[i].status == status)
      return status_table[i].name;
  }
  return "unknown error";
}
