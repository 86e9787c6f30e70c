/* zerod: the binary's entry (docs/architecture.md).
 *
 *   zerod [standalone]   one node daemon with N CPU ranks and its rendezvous
 *                        in this process, socket and state in a local dir
 *   zerod node           a node daemon that joins a coordinator
 *   zerod coordinator    the cluster's coordinator (coord.h) over gRPC
 *
 * Every flag has a ZEROD_* environment variable; a flag wins over the
 * variable. The command lines are tables (cli/flags.h); each mode has a
 * main of its own (cli/mode.h): `coordinator` must come first, while
 * `standalone` and `node` may follow the options, so those two share one
 * main that reads the word after the options. */
#include <string.h>

#include "mode.h"

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "coordinator") == 0)
    return mode_coordinator_main(argc - 1, argv + 1);
  return mode_node_main(argc, argv);
}
