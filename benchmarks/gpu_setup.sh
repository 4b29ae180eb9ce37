# Sourced at the start of a device call: installs the carried wheels (../shared/device/wheels.sh
# filled .whl/) and puts a copy of the package (ops/ as lrmoe_ds/ops) on PYTHONPATH.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || return 1
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r lrmoe_ds /tmp/pkg/ && rm -rf /tmp/pkg/lrmoe_ds/ops && cp -r ops /tmp/pkg/lrmoe_ds/ops
export PYTHONPATH=/tmp/pkg:/tmp/site PATH=/tmp/site/bin:$PATH MAX_JOBS=16 PYTHONUNBUFFERED=1
