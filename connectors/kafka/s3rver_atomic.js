// s3rver's command line, with whole-object writes.
//
// s3rver 3.7.1 streams a PUT's body straight into the object's file, opened
// with truncation. When the client dies mid-request (the chaos harness
// SIGKILLs the broker), the object is left cut short or empty, and the
// broker's next start reads a metadata object that is not JSON and never
// serves again. Here a PUT writes beside the object and renames into place
// only once the whole declared body is on disk, as S3 itself promises: a
// reader sees the old object or the new one, never a part.
//
// Run as: S3RVER_PACKAGE_DIR=<.../node_modules/s3rver> node s3rver_atomic.js <s3rver's args>
'use strict';

const crypto = require('crypto');
const path = require('path');
const { pipeline, Transform } = require('stream');

const packageDir = process.env.S3RVER_PACKAGE_DIR;
if (!packageDir) {
  console.error('S3RVER_PACKAGE_DIR must name the s3rver package directory');
  process.exit(2);
}
const fs = require(require.resolve('fs-extra', { paths: [packageDir] }));
const FilesystemStore = require(path.join(packageDir, 'lib', 'stores', 'filesystem.js'));

FilesystemStore.prototype.putObject = async function putObject(object) {
  const objectPath = this.getResourcePath(object.bucket, object.key, 'object');
  await fs.mkdirp(path.dirname(objectPath));
  const partialPath = `${objectPath}.partial-${process.pid}-${crypto.randomBytes(6).toString('hex')}`;
  const md5Context = crypto.createHash('md5');
  let size = 0;
  try {
    if (Buffer.isBuffer(object.content)) {
      await fs.writeFile(partialPath, object.content);
      md5Context.update(object.content);
      size = object.content.length;
    } else {
      await new Promise((resolve, reject) => {
        const counter = new Transform({
          transform(chunk, encoding, callback) {
            md5Context.update(chunk, encoding);
            size += chunk.length;
            callback(null, chunk);
          },
        });
        // pipeline, unlike pipe, fails when the request ends early (the client died).
        pipeline(object.content, counter, fs.createWriteStream(partialPath), err =>
          err ? reject(err) : resolve(),
        );
      });
      const declared = Number(object.content.headers && object.content.headers['content-length']);
      if (Number.isFinite(declared) && declared !== size) {
        throw new Error(`request body ended after ${size} of ${declared} bytes`);
      }
    }
    const md5 = md5Context.digest('hex');
    await this.putMetadata(object.bucket, object.key, object.metadata, md5);
    await fs.rename(partialPath, objectPath);
    return { size, md5 };
  } catch (err) {
    await fs.remove(partialPath).catch(() => {});
    throw err;
  }
};

require(path.join(packageDir, 'bin', 's3rver.js'));
