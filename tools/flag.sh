# The one-switch command line of the tools' scripts (sourced by tools/test.sh and
# tools/check_format.sh):
#
#   switch_given SCRIPT FLAG "$@"
#
# succeeds when FLAG is among the arguments and fails when none was given; any other argument
# ends the script with exit status 2 and one line naming it and the flag SCRIPT knows.
switch_given() {
  local script=$1 flag=$2 arg given=1
  shift 2
  for arg in "$@"; do
    case "$arg" in
    "$flag") given=0 ;;
    *) echo "$script: error: unknown flag '$arg' (known: $flag)" >&2; exit 2 ;;
    esac
  done
  return "$given"
}
