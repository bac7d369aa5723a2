// cache-dit-opdctl: admin/ctl/opdctl.h is the whole of it.
#include <iostream>

#include "admin/ctl/opdctl.h"

int main(int argc, char** argv) { return cache_dit_opd::admin::RunOpdctl(argc, argv, std::cout, std::cerr); }
