cd /work/main
out=/tmp/binds_ab; rm -rf $out; mkdir -p $out
for r in 1 2 3; do
  for side in A M B; do
    rev=$([ $side = A ] && echo 8cf0829 || ([ $side = M ] && echo a6ec8a1 || echo HEAD))
    git checkout -q $rev -- python csrc generated
    for fresh in "" "--fresh-verifies"; do
      tag=$([ -z "$fresh" ] && echo shared || echo fresh)
      .venv/bin/python -m bench.bench_binds --repeats 25 $fresh --out $out/${side}_${tag}_$r.json > /dev/null 2>&1 || echo fail $side
      echo "$side $r $tag $(cat $out/${side}_${tag}_$r.json)"
    done
  done
done
git checkout -q HEAD -- python csrc generated
