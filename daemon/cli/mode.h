/* mode: zerod's modes, one main each (mode_node.c, mode_coordinator.c,
 * which include this header), called by main.c with the command line
 * (argv[0] the program's or the mode's name). Each returns the process's
 * exit status: 0, 1 when it could not start or stopped on an error, 2 for
 * a bad command line. */
#ifndef ZEROD_MODE_H
#define ZEROD_MODE_H

/* zerod [standalone] and zerod node (mode_node.c): the mode is the word
 * after the options, standalone when there is none. */
int mode_node_main(int argc, char **argv);

/* zerod coordinator (mode_coordinator.c); argv[0] is "coordinator". */
int mode_coordinator_main(int argc, char **argv);

#endif /* ZEROD_MODE_H */
