#!/data/data/com.termux/files/usr/bin/sh
# Run once inside Termux (not over adb): installs what the testbed agent needs.
#   sh termux-setup.sh
# Termux ships numpy and grpcio as prebuilt packages; `pip install` would compile them on the phone.
set -e
pkg update -y
pkg install -y python python-numpy python-grpcio
python -c "import numpy, grpc; print('testbed agent prerequisites: numpy', numpy.__version__, 'grpcio', grpc.__version__)"
