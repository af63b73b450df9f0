/* The C APIs of librados and librbd, as Debian's librados-dev and librbd-dev install them. */
#include <rados/librados.h>
#include <rbd/librbd.h>
